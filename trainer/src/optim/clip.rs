//! Global-norm gradient clipping: on the host buffer the ring reduced (in f64, in a fixed
//! order, so every rank clips alike), and where a GPU's gradient buffer lies (the same
//! formula, its norm summed on the device).

use tch::{Kind, Tensor};

/// Scales `grad` so its L2 norm is at most `max_norm`; returns the norm before clipping.
/// Computed in f64 over the reduced buffer, so every rank clips identically.
pub fn clip_global_norm(grad: &mut [f32], max_norm: Option<f64>) -> f64 {
    clip_to_norm(grad, sum_of_squares(grad).sqrt(), max_norm)
}

/// The sum of the squares of `values` in f64, in eight interleaved partial sums: a fixed
/// order (so every rank gets the same bits) that the compiler can vectorise, which one
/// running sum cannot be (each addition would wait for the one before).
pub fn sum_of_squares(values: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(*v) * f64::from(*v);
        }
    }
    let body: f64 = lanes.iter().sum();
    body + tail.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>()
}

/// Scales `grad`, a part of a gradient whose whole norm is `norm` (a pipeline stage's
/// slice), as [`clip_global_norm`] scales the whole; returns `norm`.
pub fn clip_to_norm(grad: &mut [f32], norm: f64, max_norm: Option<f64>) -> f64 {
    if let Some(max) = max_norm {
        if norm > max {
            let s = (max / (norm + 1e-6)) as f32;
            grad.iter_mut().for_each(|g| *g *= s);
        }
    }
    norm
}

/// Values of a gradient squared and summed on the device a piece at a time: in f64, with no
/// model-sized f64 copy (one piece of this many values at a time).
const DEVICE_NORM_PIECE: i64 = 1 << 20;

/// The sum of the squares of `values` (f32, flat, on any device) in f64, computed on their
/// device a piece at a time and read back once: what [`sum_of_squares`] computes on the
/// host, in another order (its last bits may differ).
pub fn device_sum_of_squares(values: &Tensor) -> Result<f64, tch::TchError> {
    device_squares(values)?.f_double_value(&[])
}

/// [`device_sum_of_squares`] left on the device as a 0-dimensional f64 tensor: summed with
/// others there, it is read (one wait for the device) once.
pub fn device_squares(values: &Tensor) -> Result<Tensor, tch::TchError> {
    let n = values.numel() as i64;
    let mut total: Option<Tensor> = None;
    for at in (0..n).step_by(DEVICE_NORM_PIECE as usize) {
        let piece = values.f_narrow(0, at, DEVICE_NORM_PIECE.min(n - at))?.f_to_kind(Kind::Double)?;
        let sq = piece.f_dot(&piece)?;
        total = Some(match total {
            Some(t) => t.f_add(&sq)?,
            None => sq,
        });
    }
    match total {
        Some(t) => Ok(t),
        None => Tensor::f_zeros([], (Kind::Double, values.device())),
    }
}

/// Averages and clips a reduced gradient where it lies (a GPU's gradient buffer): multiplies
/// it by `scale` (one over the sample count, in f32 as the host path does), then, as
/// [`clip_global_norm`], scales it so its L2 norm is at most `max_norm`. Returns the norm
/// before clipping. The same formula as the host's: the norm's last bits may differ (another
/// summation order), which moves the f32 clipping factor only when they straddle a rounding.
pub fn scale_and_clip_on_device(
    grad: &Tensor,
    scale: f32,
    max_norm: Option<f64>,
) -> Result<f64, tch::TchError> {
    let mut g = grad.shallow_clone();
    let _ = g.f_mul_scalar_(f64::from(scale))?;
    let norm = device_sum_of_squares(&g)?.sqrt();
    if let Some(max) = max_norm {
        if norm > max {
            let s = (max / (norm + 1e-6)) as f32;
            let _ = g.f_mul_scalar_(f64::from(s))?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_caps_the_norm() {
        let mut g = vec![3.0, 4.0];
        assert_eq!(clip_global_norm(&mut g, Some(1.0)), 5.0);
        assert!((g[0] - 0.6).abs() < 1e-5 && (g[1] - 0.8).abs() < 1e-5);
        let mut g = vec![0.3, 0.4];
        clip_global_norm(&mut g, Some(1.0));
        assert_eq!(g, vec![0.3, 0.4]);
    }

    /// Averaging, the norm and clipping where a GPU's buffer lies compute the host's: the
    /// same averaged and clipped bits, the norm to f64 rounding, across pieces of the
    /// device's sum and with clipping off, active and inactive.
    #[test]
    fn averaging_and_clipping_on_the_device_compute_the_hosts() {
        for (n, max) in [(7usize, Some(1.0)), (3 << 20 | 5, Some(0.5)), (1000, Some(1e9)), (4096, None)] {
            let host: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-3).collect();
            let scale = 1.0f32 / 24.0;
            let mut want = host.clone();
            want.iter_mut().for_each(|g| *g *= scale);
            let want_norm = clip_global_norm(&mut want, max);
            let on_device = Tensor::from_slice(&host);
            let norm = scale_and_clip_on_device(&on_device, scale, max).unwrap();
            assert!((norm - want_norm).abs() <= 1e-12 * want_norm, "{n}: norm {norm} vs {want_norm}");
            let got = Vec::<f32>::try_from(&on_device).unwrap();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{n}: other bits");
            let clipped = max.is_some_and(|m| want_norm > m);
            assert_eq!(clipped, got.iter().zip(&host).any(|(g, h)| *g != *h * scale), "{n}: clipping");
        }
    }
}
