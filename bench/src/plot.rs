//! SVG plots with plotters (SVG backend only: the text is left to the viewer's
//! fonts, so no font library is linked).

use plotters::prelude::*;
use std::path::Path;

const PALETTE: [RGBColor; 6] = [
    RGBColor(0x2e, 0x9e, 0x44), // greendot green
    RGBColor(0xd6, 0x2d, 0x20), // redis red
    RGBColor(0x1f, 0x6f, 0xb5),
    RGBColor(0xe0, 0x8a, 0x00),
    RGBColor(0x7a, 0x4e, 0xa3),
    RGBColor(0x55, 0x55, 0x55),
];

pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// One group of a grouped bar chart: a label under the group and one value per
/// series.
pub struct Group {
    pub label: String,
    pub values: Vec<f64>,
}

/// A grouped bar chart: `groups` along x, one bar per series in each, the
/// value written above each bar.
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_desc: &str,
    series: &[&str],
    groups: &[Group],
    log_y: bool,
) -> PlotResult {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = groups
        .iter()
        .flat_map(|g| g.values.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let min_pos = groups
        .iter()
        .flat_map(|g| g.values.iter().copied())
        .filter(|v| *v > 0.0)
        .fold(f64::INFINITY, f64::min);
    let n = groups.len() as f64;
    let width = 0.8 / series.len().max(1) as f64;
    let fmt = |v: f64| crate::si(v);
    let labels: Vec<String> = groups.iter().map(|g| g.label.clone()).collect();
    let x_fmt = move |x: &f64| {
        let i = x.floor();
        if (x - i - 0.5).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
            labels[i as usize].clone()
        } else {
            String::new()
        }
    };
    macro_rules! draw {
        ($chart:expr, $y0:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(groups.len() * 2 + 1)
                .x_label_formatter(&x_fmt)
                .y_desc(y_desc)
                .y_label_formatter(&|v| fmt(*v))
                .draw()?;
            for (s, name) in series.iter().enumerate() {
                let c = color(s);
                chart
                    .draw_series(groups.iter().enumerate().filter_map(|(i, g)| {
                        let v = *g.values.get(s)?;
                        let x0 = i as f64 + 0.1 + width * s as f64;
                        Some(Rectangle::new(
                            [(x0, $y0), (x0 + width * 0.95, v)],
                            c.filled(),
                        ))
                    }))?
                    .label(*name)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled())
                    });
                chart.draw_series(groups.iter().enumerate().filter_map(|(i, g)| {
                    let v = *g.values.get(s)?;
                    let x0 = i as f64 + 0.1 + width * s as f64;
                    Some(Text::new(
                        fmt(v),
                        (x0, v),
                        ("sans-serif", 13).into_font().color(&BLACK),
                    ))
                }))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80);
    if log_y {
        let lo = (min_pos / 3.0).max(1e-9);
        draw!(
            builder.build_cartesian_2d(0.0..n, (lo..max * 3.0).log_scale())?,
            lo
        );
    } else {
        draw!(builder.build_cartesian_2d(0.0..n, 0.0..max * 1.15)?, 0.0);
    }
    root.present()?;
    Ok(())
}

/// Lines with points: one series per name, over a log or linear x axis.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> PlotResult {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let pts = series.iter().flat_map(|(_, s)| s.iter().copied());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, 0.0f64, 0.0f64);
    for (x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        x0 = 1.0;
        x1 = 10.0;
    }
    let y1 = (y1 * 1.15).max(1e-9);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .x_label_formatter(&|v| crate::si(*v))
                .y_label_formatter(&|v| crate::si(*v))
                .draw()?;
            for (i, (name, s)) in series.iter().enumerate() {
                let c = color(i);
                chart
                    .draw_series(LineSeries::new(s.iter().copied(), c.stroke_width(2)))?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                    });
                chart.draw_series(s.iter().map(|&(x, y)| Circle::new((x, y), 4, c.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80);
    if log_x {
        draw!(builder.build_cartesian_2d((x0 / 1.5..x1 * 1.5).log_scale(), 0.0..y1)?);
    } else {
        draw!(builder.build_cartesian_2d(0.0..x1 * 1.05, 0.0..y1)?);
    }
    root.present()?;
    Ok(())
}
