//! Plain-text tables for the command line: borderless, numbers aligned right, no padding
//! after the last column.

/// A borderless table with `header`, its columns `right` aligned right (the numbers).
pub(crate) fn table(header: &[&str], right: std::ops::Range<usize>) -> comfy_table::Table {
    use comfy_table::{Cell, CellAlignment, ContentArrangement, Table};
    let align = |i: usize| if right.contains(&i) { CellAlignment::Right } else { CellAlignment::Left };
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::NOTHING).set_content_arrangement(ContentArrangement::Disabled);
    t.set_header(header.iter().enumerate().map(|(i, h)| Cell::new(h).set_alignment(align(i))));
    for (i, c) in t.column_iter_mut().enumerate() {
        c.set_cell_alignment(align(i));
        c.set_padding((0, 2));
    }
    t
}

/// A table's text without the padding after the last column.
pub(crate) fn lines(t: &comfy_table::Table) -> String {
    t.to_string().lines().map(str::trim_end).collect::<Vec<_>>().join("\n")
}
