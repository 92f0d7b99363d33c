//! SVG charts: what every chart of the project shares (the page, a chart's frame, its legend,
//! count labels), and the training curves drawn with it.

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// Draws a chart of `size` pixels into an SVG file at `path`: a white page, `draw` on it, the
/// file written; a failure says which file it was drawing.
pub fn draw_svg<'p>(
    path: &'p Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'p>, Shift>) -> Result<(), Box<dyn std::error::Error>>,
) -> crate::Result<()> {
    let page = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, size).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
        Ok(())
    };
    Ok(page().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("drawing {}", path.display()))?)
}

/// A chart on `area` framed as every chart is: a 12-pixel margin, `x_label_area` pixels for
/// the x axis's labels, 60 for the y axis's, and `title`, if any, as its caption. A chart
/// framed otherwise overrides what differs before building.
pub fn chart_on<'a, 'b, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: Option<&str>,
    x_label_area: u32,
) -> ChartBuilder<'a, 'b, DB> {
    let mut builder = ChartBuilder::on(area);
    if let Some(title) = title {
        builder.caption(title, ("sans-serif", 20));
    }
    builder.margin(12).x_label_area_size(x_label_area).y_label_area_size(60);
    builder
}

/// A line series' mark in a legend: a short line in its colour.
pub fn legend_line(colour: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour)
}

/// Draws `chart`'s legend at `position`: its series' marks and labels in a black-bordered
/// box, the chart showing faintly through.
pub fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    Ok(())
}

/// A tick label for a count drawn on an `f64` axis (steps, samples): `500`, not `500.0`.
pub fn count_label(v: &f64) -> String {
    format!("{v:.0}")
}

/// One point of a loss curve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossPoint {
    /// The step (1-based count of applied steps).
    pub step: u64,
    /// Training loss.
    pub loss: f64,
    /// Test loss, where it was measured.
    pub test_loss: Option<f64>,
}

/// Draws training loss per step, and test loss where it was measured, on a log scale.
pub fn loss_svg(path: &Path, records: &[LossPoint], title: &str) -> crate::Result<()> {
    draw_svg(path, (900, 420), |root| {
        let finite = |v: f64| v.is_finite() && v > 0.0;
        let losses =
            records.iter().flat_map(|r| [Some(r.loss), r.test_loss]).flatten().filter(|v| finite(*v));
        let (lo, hi) = losses.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo <= hi { (lo * 0.8, hi * 1.25) } else { (0.01, 10.0) };
        let last = records.last().map_or(1, |r| r.step).max(1) as f64;
        let mut chart =
            chart_on(root, Some(title), 36).build_cartesian_2d(0f64..last, (lo..hi).log_scale())?;
        chart.configure_mesh().x_desc("step").x_label_formatter(&count_label).y_desc("loss").draw()?;
        chart
            .draw_series(LineSeries::new(
                records.iter().filter(|r| finite(r.loss)).map(|r| (r.step as f64, r.loss)),
                &BLUE,
            ))?
            .label("train loss")
            .legend(legend_line(BLUE));
        let test: Vec<_> = records
            .iter()
            .filter_map(|r| r.test_loss.filter(|v| finite(*v)).map(|l| (r.step as f64, l)))
            .collect();
        chart
            .draw_series(test.iter().map(|p| Circle::new(*p, 4, RED.filled())))?
            .label("test loss")
            .legend(|(x, y)| Circle::new((x + 9, y), 4, RED.filled()));
        draw_legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
        Ok(())
    })
}

/// One completed step of an elastic run, for `elastic_svg`.
#[cfg(feature = "lab")]
pub struct ElasticPoint {
    /// Step.
    pub step: u64,
    /// Global loss.
    pub loss: f64,
    /// World size of its epoch.
    pub world: usize,
    /// The held-out loss after it, when the job evaluated (`eval_every`).
    pub eval_loss: Option<f64>,
}

/// Draws loss (top, log scale) and world size (bottom) against step, with every transition
/// marked by a vertical line and its label (the demo's plot: lab builds only).
#[cfg(feature = "lab")]
pub fn elastic_svg(
    path: &Path,
    points: &[ElasticPoint],
    transitions: &[(u64, String)],
    title: &str,
) -> crate::Result<()> {
    draw_svg(path, (1000, 640), |root| {
        let last = points.last().map_or(1, |p| p.step).max(1) as f64;
        let finite: Vec<&ElasticPoint> =
            points.iter().filter(|p| p.loss.is_finite() && p.loss > 0.0).collect();
        let (lo, hi) = finite.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.loss), b.max(p.loss)));
        let (lo, hi) = if lo <= hi { (lo * 0.8, hi * 1.25) } else { (0.01, 10.0) };
        // World sizes are whole hosts: an integer axis, one tick per size.
        let max_world = points.iter().map(|p| p.world).max().unwrap_or(1) + 1;
        let (top, bottom) = root.split_vertically(420);
        let mut chart =
            chart_on(&top, Some(title), 30).build_cartesian_2d(0f64..last, (lo..hi).log_scale())?;
        chart.configure_mesh().x_label_formatter(&count_label).y_desc("loss").draw()?;
        // A light per-step line and a 25-step moving average on top.
        chart.draw_series(LineSeries::new(finite.iter().map(|p| (p.step as f64, p.loss)), BLUE.mix(0.25)))?;
        let k = 25usize;
        let smooth: Vec<(f64, f64)> = finite
            .windows(k.min(finite.len()).max(1))
            .map(|w| (w[w.len() - 1].step as f64, w.iter().map(|p| p.loss).sum::<f64>() / w.len() as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(smooth, &BLUE))?
            .label("train loss (25-step mean)")
            .legend(legend_line(BLUE));
        let held_out: Vec<(f64, f64)> = points
            .iter()
            .filter_map(|p| p.eval_loss.filter(|l| l.is_finite() && *l > 0.0).map(|l| (p.step as f64, l)))
            .collect();
        if !held_out.is_empty() {
            let green = RGBColor(0, 140, 60);
            chart
                .draw_series(LineSeries::new(held_out.clone(), green.stroke_width(2)))?
                .label("held-out loss")
                .legend(legend_line(green));
            chart.draw_series(held_out.iter().map(|&p| Circle::new(p, 3, green.filled())))?;
        }
        for (step, label) in transitions {
            let x = *step as f64;
            chart.draw_series(LineSeries::new(vec![(x, lo), (x, hi)], RED.mix(0.6)))?;
            chart.draw_series(std::iter::once(Text::new(
                label.clone(),
                (x, hi / 1.15),
                ("sans-serif", 13).into_font().color(&RED),
            )))?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
        let mut world = chart_on(&bottom, None, 36).build_cartesian_2d(0f64..last, 0usize..max_world)?;
        world
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&count_label)
            .y_desc("world size")
            .y_labels(max_world + 1)
            .draw()?;
        let mut steps = Vec::new();
        for p in points {
            if let Some(&(_, w)) = steps.last() {
                steps.push((p.step as f64, w));
            }
            steps.push((p.step as f64, p.world));
        }
        world.draw_series(LineSeries::new(steps, GREEN.stroke_width(2)))?;
        for (step, _) in transitions {
            let x = *step as f64;
            world.draw_series(LineSeries::new(vec![(x, 0), (x, max_world)], RED.mix(0.6)))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of every `<text>` element of an SVG.
    fn labels(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string()))
            .collect()
    }

    #[cfg(feature = "lab")]
    #[test]
    fn counts_and_world_sizes_are_labelled_as_whole_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("elastic.svg");
        let points: Vec<ElasticPoint> = (1..=1000)
            .map(|s| ElasticPoint {
                step: s,
                loss: 1.0 / s as f64,
                world: if s < 500 { 3 } else { 2 },
                eval_loss: (s % 100 == 0).then(|| 1.5 / s as f64),
            })
            .collect();
        elastic_svg(&path, &points, &[(500, "notice".into())], "t").unwrap();
        let l = labels(&std::fs::read_to_string(&path).unwrap());
        assert!(l.iter().any(|t| t == "500"), "{l:?}");
        assert!(l.iter().any(|t| t == "3"), "{l:?}");
        // Losses (below 2 here) may have decimals; steps and world sizes may not.
        for t in l.iter().filter(|t| t.parse::<f64>().is_ok_and(|v| v >= 2.0)) {
            assert!(!t.contains('.'), "a fractional count or world size {t:?} in {l:?}");
        }
        assert!(!l.iter().any(|t| t == "3.5" || t == "2.5"), "{l:?}");
        let loss = dir.path().join("loss.svg");
        let records: Vec<LossPoint> =
            (1..=1000).map(|s| LossPoint { step: s, loss: 1.0, test_loss: None }).collect();
        loss_svg(&loss, &records, "t").unwrap();
        let l = labels(&std::fs::read_to_string(&loss).unwrap());
        assert!(l.iter().any(|t| t == "500") && !l.iter().any(|t| t == "500.0"), "{l:?}");
    }
}
