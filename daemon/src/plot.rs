//! SVG plots of training curves.

use crate::train_cmd::StepRecord;
use anyhow::Context;
use plotters::prelude::*;
use std::path::Path;

/// Draws training loss per step, and test loss where it was measured, on a log scale.
pub fn loss_svg(path: &Path, records: &[StepRecord], title: &str) -> anyhow::Result<()> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let finite = |v: f64| v.is_finite() && v > 0.0;
        let losses =
            records.iter().flat_map(|r| [Some(r.loss), r.test_loss]).flatten().filter(|v| finite(*v));
        let (lo, hi) = losses.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo <= hi { (lo * 0.8, hi * 1.25) } else { (0.01, 10.0) };
        let last = records.last().map_or(1, |r| r.step).max(1) as f64;
        let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..last, (lo..hi).log_scale())?;
        chart.configure_mesh().x_desc("step").y_desc("loss").draw()?;
        chart
            .draw_series(LineSeries::new(
                records.iter().filter(|r| finite(r.loss)).map(|r| (r.step as f64, r.loss)),
                &BLUE,
            ))?
            .label("train loss")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE));
        let test: Vec<_> = records
            .iter()
            .filter_map(|r| r.test_loss.filter(|v| finite(*v)).map(|l| (r.step as f64, l)))
            .collect();
        chart
            .draw_series(test.iter().map(|p| Circle::new(*p, 4, RED.filled())))?
            .label("test loss")
            .legend(|(x, y)| Circle::new((x + 9, y), 4, RED.filled()));
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("drawing {}", path.display()))
}
