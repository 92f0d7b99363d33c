//! The collector a configuration's checks report into: every problem at once, each with its
//! `[section].key` and the line that key is on, so one run of `limpetd validate` names all a
//! file's mistakes instead of one per attempt.

use std::fmt;

/// A configuration problem: which file, key and line, and what is wrong. Shown as
/// `FILE:LINE: [section].key: what` (as compilers show a line, so editors jump to it), or
/// `FILE: [section].key: what` for a key the file does not set.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// The key, as `[section].name` (or `[section]`, or `(file)`).
    pub key: String,
    /// The line the key is on, when the file says it.
    pub line: Option<usize>,
    /// What is wrong.
    pub detail: String,
}

impl ConfigError {
    /// A problem with `key` of `file` (its line not looked up).
    pub fn new(file: &str, key: &str, detail: impl Into<String>) -> ConfigError {
        ConfigError { file: file.into(), key: key.into(), line: None, detail: detail.into() }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(n) => write!(f, "{}:{n}: {}: {}", self.file, self.key, self.detail),
            None => write!(f, "{}: {}: {}", self.file, self.key, self.detail),
        }
    }
}

/// Every problem found in one file, in the order the checks met them (never empty).
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    /// The first problem.
    pub fn first(&self) -> &ConfigError {
        &self.0[0]
    }

    /// Every problem.
    pub fn all(&self) -> &[ConfigError] {
        &self.0
    }
}

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> ConfigErrors {
        ConfigErrors(vec![e])
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Collects a file's problems as its checks run.
pub struct Checks<'a> {
    file: &'a str,
    text: &'a str,
    errors: Vec<ConfigError>,
}

impl<'a> Checks<'a> {
    /// Checks of `text`, read from `file`.
    pub fn new(file: &'a str, text: &'a str) -> Checks<'a> {
        Checks { file, text, errors: Vec::new() }
    }

    /// The file's name.
    pub fn file(&self) -> &str {
        self.file
    }

    /// Records that `key` is wrong.
    pub fn fail(&mut self, key: &str, detail: impl Into<String>) {
        self.push(ConfigError::new(self.file, key, detail));
    }

    /// Records a problem a section's own check found, finding its line.
    pub fn push(&mut self, mut e: ConfigError) {
        if e.line.is_none() {
            e.line = line_of(self.text, &e.key);
        }
        self.errors.push(e);
    }

    /// The value, or records why `key` has none.
    pub fn take<T, E: std::fmt::Display>(&mut self, key: &str, r: Result<T, E>) -> Option<T> {
        r.map_err(|why| self.fail(key, why.to_string())).ok()
    }

    /// Every problem found so far, or none (then checks that need good values may go on).
    pub fn so_far(&mut self) -> Result<(), ConfigErrors> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors(std::mem::take(&mut self.errors)))
        }
    }

    /// Every problem found, or none.
    pub fn finish(mut self) -> Result<(), ConfigErrors> {
        self.so_far()
    }
}

/// The line `key` (`[section].name`, `[section]`) is set on in a TOML text: the section's
/// header, then the first `name =` line under it. `None` when the file does not set it (a
/// default, or a missing section), or sets it some way this does not follow (a dotted key, an
/// inline table).
pub fn line_of(text: &str, key: &str) -> Option<usize> {
    let rest = key.strip_prefix('[')?;
    let (section, name) = rest.split_once(']')?;
    let name = name.strip_prefix('.').unwrap_or("");
    let mut lines = text.lines().enumerate();
    let (at, _) = lines.find(|(_, l)| header(l).is_some_and(|s| s == section))?;
    if name.is_empty() {
        return Some(at + 1);
    }
    for (i, l) in lines {
        if header(l).is_some() {
            return None;
        }
        if l.split_once('=').is_some_and(|(k, _)| k.trim().trim_matches(['"', '\'']) == name) {
            return Some(i + 1);
        }
    }
    None
}

/// Where byte `offset` of a TOML file is, for a parse error: `[section].key` when the line
/// is a `key = value` line (`line N` otherwise), and the line.
pub fn key_at(text: &str, offset: usize) -> (String, Option<usize>) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_no = before.matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("");
    let section = before.lines().rev().find_map(header).unwrap_or_default();
    match line.split_once('=') {
        Some((key, _)) if !key.trim().is_empty() && header(line).is_none() => {
            (format!("[{section}].{}", key.trim()), Some(line_no))
        }
        _ => (format!("line {line_no}"), Some(line_no)),
    }
}

/// The sections a configuration file must have (`Config`'s fields without a default).
const REQUIRED_SECTIONS: [&str; 3] = ["node", "cluster", "job"];

/// The key a "missing field `field`" error is about, from the span the parser gave (within
/// the table it was missing from) and its line: a required section the file lacks, or
/// `[section].field` with the section's header line.
pub fn missing_key(text: &str, span: Option<std::ops::Range<usize>>, field: &str) -> (String, Option<usize>) {
    if REQUIRED_SECTIONS.contains(&field) && !text.lines().any(|l| header(l).as_deref() == Some(field)) {
        return (format!("[{field}]"), None);
    }
    let start = span.map_or(0, |s| s.start).min(text.len());
    // The table the span starts in: its header is on the span's line, or the last before it.
    let upto = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[upto..].find('\n').map_or(text.len(), |i| upto + i);
    let found =
        text[..line_end].lines().enumerate().filter_map(|(i, l)| header(l).map(|h| (h, i + 1))).last();
    match found {
        Some((section, line)) => (format!("[{section}].{field}"), Some(line)),
        None => (field.to_string(), None),
    }
}

/// The section a `[header]` line opens (`[[array]]` headers too), comments and spaces aside.
fn header(line: &str) -> Option<String> {
    let l = line.trim();
    let inner = l
        .strip_prefix("[[")
        .and_then(|r| r.split_once("]]"))
        .map(|(s, _)| s)
        .or_else(|| l.strip_prefix('[').and_then(|r| r.split_once(']')).map(|(s, _)| s))?;
    Some(inner.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    #[test]
    fn a_key_is_found_on_its_line_in_its_own_section_only() {
        let text = "[node]\nname = \"a\"\ncontrol = \"x\"\n\n[cluster]\nname = \"c\"\n[security.ssm]\nprefix = \"p\"\n";
        assert_eq!(line_of(text, "[node].control"), Some(3));
        assert_eq!(line_of(text, "[cluster].name"), Some(6));
        assert_eq!(line_of(text, "[cluster]"), Some(5));
        assert_eq!(line_of(text, "[security.ssm].prefix"), Some(8));
        // Set in another section, or not at all: no line rather than a wrong one.
        assert_eq!(line_of(text, "[cluster].control"), None);
        assert_eq!(line_of(text, "[timing].lead_ms"), None);
        assert_eq!(line_of(text, "(file)"), None);
    }

    #[test]
    fn every_problem_is_kept_and_shown_on_its_own_line() {
        let text = "[node]\nname = \"\"\ncontrol = \"nowhere\"\n";
        let mut c = Checks::new("f.toml", text);
        use limpet_agent::config_value::FromText;
        assert_eq!(c.take("[node].control", SocketAddr::from_text("nowhere")), None);
        c.fail("[node].name", "is empty");
        c.fail("[timing].lead_ms", "too small");
        let e = c.finish().unwrap_err();
        assert_eq!(
            e.to_string(),
            "f.toml:3: [node].control: \"nowhere\" is not IP:PORT (invalid socket address syntax; a host name such as localhost is not looked up)\n\
             f.toml:2: [node].name: is empty\n\
             f.toml: [timing].lead_ms: too small"
        );
        assert_eq!(e.first().key, "[node].control");
    }

    #[test]
    fn a_parse_error_is_placed_on_its_own_line_in_its_section() {
        let text = "[node]\nname = \"a\"\n[capacity] # the fleet\ninstance_types = \"g5\"\ntarrget = 3\n";
        let at = text.find("tarrget").unwrap();
        assert_eq!(key_at(text, at), ("[capacity].tarrget".into(), Some(5)));
        // A line without `=` still has its line; an offset past the end or inside a
        // character does not panic.
        let at = text.find("[capacity]").unwrap();
        assert_eq!(key_at(text, at), ("line 3".into(), Some(3)));
        assert_eq!(key_at("é = 1", 1).1, Some(1));
        assert_eq!(key_at("", 10), ("line 1".into(), Some(1)));
        assert_eq!(line_of("[ node ]\n'name' = 1\r\n", "[node].name"), Some(2));
    }
}
