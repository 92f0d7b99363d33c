//! The simulation's plot: live hosts and the job's progress over time, per policy.

use super::model::Outcome;
use anyhow::Context;
use plotters::prelude::*;
use std::path::Path;

/// Draws, for each simulated policy (named by its label), live hosts (top) and the fraction
/// of the job done (bottom) against hours.
pub fn simulation_svg(path: &Path, outcomes: &[(String, &Outcome)], title: &str) -> crate::Result<()> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let hours = outcomes.iter().map(|o| o.1.hours).fold(0.0, f64::max).max(1e-3);
        let hosts = outcomes.iter().flat_map(|o| o.1.timeline.iter().map(|p| p.1)).max().unwrap_or(1) + 1;
        let root = SVGBackend::new(path, (1000, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(300);
        let colours = [BLUE, RED, GREEN];
        let mut live = ChartBuilder::on(&top)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..hours, 0usize..hosts)?;
        live.configure_mesh().y_desc("live hosts").draw()?;
        let mut done = ChartBuilder::on(&bottom)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..hours, 0f64..100f64)?;
        done.configure_mesh().x_desc("hours").y_desc("job done (%)").draw()?;
        for ((label, o), colour) in outcomes.iter().zip(colours) {
            let name = o.policy.name();
            live.draw_series(LineSeries::new(o.timeline.iter().map(|p| (p.0, p.1)), colour.mix(0.7)))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
            done.draw_series(LineSeries::new(
                o.timeline.iter().map(|p| (p.0, p.2 * 100.0)),
                colour.stroke_width(2),
            ))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], colour));
        }
        live.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
        done.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
        Ok(())
    };
    Ok(draw().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("drawing {}", path.display()))?)
}
