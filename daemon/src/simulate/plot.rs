//! The simulation's plot: live hosts and the job's progress over time, per policy (drawn with
//! what `crate::plot` shares among charts).

use super::model::Outcome;
use crate::plot::{chart_on, draw_legend, draw_svg, legend_line};
use plotters::prelude::*;
use std::path::Path;

/// Draws, for each simulated policy (named by its label), live hosts (top) and the fraction
/// of the job done (bottom) against hours.
pub fn simulation_svg(path: &Path, outcomes: &[(String, &Outcome)], title: &str) -> crate::Result<()> {
    draw_svg(path, (1000, 640), |root| {
        let hours = outcomes.iter().map(|o| o.1.hours).fold(0.0, f64::max).max(1e-3);
        let hosts = outcomes.iter().flat_map(|o| o.1.timeline.iter().map(|p| p.1)).max().unwrap_or(1) + 1;
        let (top, bottom) = root.split_vertically(300);
        let colours = [BLUE, RED, GREEN];
        let mut live = chart_on(&top, Some(title), 30).build_cartesian_2d(0f64..hours, 0usize..hosts)?;
        live.configure_mesh().y_desc("live hosts").draw()?;
        let mut done = chart_on(&bottom, None, 36).build_cartesian_2d(0f64..hours, 0f64..100f64)?;
        done.configure_mesh().x_desc("hours").y_desc("job done (%)").draw()?;
        for ((label, o), colour) in outcomes.iter().zip(colours) {
            let name = o.policy.name();
            live.draw_series(LineSeries::new(o.timeline.iter().map(|p| (p.0, p.1)), colour.mix(0.7)))?
                .label(name)
                .legend(legend_line(colour));
            done.draw_series(LineSeries::new(
                o.timeline.iter().map(|p| (p.0, p.2 * 100.0)),
                colour.stroke_width(2),
            ))?
            .label(label.as_str())
            .legend(legend_line(colour));
        }
        draw_legend(&mut live, SeriesLabelPosition::MiddleRight)?;
        draw_legend(&mut done, SeriesLabelPosition::LowerRight)?;
        Ok(())
    })
}
