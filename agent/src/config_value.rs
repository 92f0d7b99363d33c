//! Configuration values read from their text while a file is parsed: addresses, byte sizes,
//! devices, stage counts and S3 URLs are their types in the sections themselves, so nothing
//! downstream reads a string again.
//!
//! serde stops a parse at its first error, and a configuration's checks report every problem
//! at once. So inside [`collect`] (how `limpetd` parses its file) a value that does not read
//! is recorded with where its text is, and a stand-in is kept: the checks report it with its
//! key and line beside every other problem, and nothing runs from a file with one. Outside
//! [`collect`] a bad value is an ordinary serde error.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use serde_spanned::Spanned;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::ops::Range;

/// A value that did not read: where its text is in the file, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unread {
    /// Its bytes in the file (the value, not the key).
    pub span: Range<usize>,
    /// What is wrong with it.
    pub detail: String,
}

thread_local! {
    static UNREAD: RefCell<Option<Vec<Unread>>> = const { RefCell::new(None) };
}

/// Runs `parse` (a TOML deserialization on this thread) with values that do not read
/// recorded rather than fatal: its result, and every value that did not read.
pub fn collect<R>(parse: impl FnOnce() -> R) -> (R, Vec<Unread>) {
    // Restores the outer state even if `parse` panics, so a later parse is not left lenient.
    struct Restore(Option<Vec<Unread>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            UNREAD.with(|u| *u.borrow_mut() = self.0.take());
        }
    }
    let restore = Restore(UNREAD.with(|u| u.replace(Some(Vec::new()))));
    let out = parse();
    let unread = UNREAD.with(|u| u.take()).unwrap_or_default();
    drop(restore);
    (out, unread)
}

fn recording() -> bool {
    UNREAD.with(|u| u.borrow().is_some())
}

/// Reads a value as `R` (a string, a number, either) and makes it a `T`: inside [`collect`],
/// a value that does not convert is recorded and `stand_in` kept. (An untagged enum's variants
/// must hold what `R` reads, not [`read`] values: it replays them without their spans.)
pub fn read_as<'de, D, R, T>(
    d: D,
    convert: impl FnOnce(R) -> Result<T, String>,
    stand_in: impl FnOnce() -> T,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
{
    if !recording() {
        return convert(R::deserialize(d)?).map_err(D::Error::custom);
    }
    let raw = Spanned::<R>::deserialize(d)?;
    let span = raw.span();
    Ok(convert(raw.into_inner()).unwrap_or_else(|detail| {
        UNREAD.with(|u| u.borrow_mut().as_mut().map(|u| u.push(Unread { span, detail })));
        stand_in()
    }))
}

/// A value a configuration writes as a string.
pub trait FromText: Sized {
    /// Reads `s`, or says why it is not one.
    fn from_text(s: &str) -> Result<Self, String>;
    /// What is kept for a value that did not read (never used: a file with an error runs
    /// nothing).
    fn stand_in() -> Self;
}

/// `#[serde(deserialize_with = "read")]`: a [`FromText`] value.
pub fn read<'de, D: Deserializer<'de>, T: FromText>(d: D) -> Result<T, D::Error> {
    read_as(d, |s: String| T::from_text(&s), T::stand_in)
}

/// `#[serde(default, deserialize_with = "read_opt")]`: an optional [`FromText`] value.
pub fn read_opt<'de, D: Deserializer<'de>, T: FromText>(d: D) -> Result<Option<T>, D::Error> {
    read(d).map(Some)
}

/// `#[serde(default, deserialize_with = "read_list")]`: a list of [`FromText`] values, each
/// recorded on its own.
pub fn read_list<'de, D: Deserializer<'de>, T: FromText>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Vec::<Text<T>>::deserialize(d)?.into_iter().map(|t| t.0).collect())
}

/// One [`FromText`] value (a list's entry).
struct Text<T>(T);

impl<'de, T: FromText> Deserialize<'de> for Text<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        read(d).map(Text)
    }
}

impl FromText for SocketAddr {
    fn from_text(s: &str) -> Result<SocketAddr, String> {
        s.parse().map_err(|e| {
            format!("{s:?} is not IP:PORT ({e}; a host name such as localhost is not looked up)")
        })
    }

    fn stand_in() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 0))
    }
}

/// A positive size in bytes, written `512M`, `16G`, `1.5T` or a plain count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

impl FromText for Bytes {
    fn from_text(s: &str) -> Result<Bytes, String> {
        parse_bytes(s).map(Bytes)
    }

    fn stand_in() -> Bytes {
        Bytes(1)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        read(d)
    }
}

/// A disk reserve: a size as [`Bytes`], or `0` for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserve(pub u64);

impl FromText for Reserve {
    fn from_text(s: &str) -> Result<Reserve, String> {
        match s.trim() {
            "0" => Ok(Reserve(0)),
            s => parse_bytes(s).map(Reserve),
        }
    }

    fn stand_in() -> Reserve {
        Reserve(0)
    }
}

impl<'de> Deserialize<'de> for Reserve {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Reserve, D::Error> {
        read(d)
    }
}

/// A byte size (`512M`, `16G`, `1.5GiB`, `4096`), for every flag and key that takes one. K,
/// M, G and T count in powers of 1024 whether written `G`, `GB` or `GiB`, as memory is
/// counted; positive, and at most 1024 PiB.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative: a size is a positive number like 512M or 16G"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = match unit.trim().to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => "B".to_string(),
        u @ ("K" | "M" | "G" | "T") => format!("{u}iB"),
        _ => return Err(format!("{s:?} has unknown unit {:?} (use K, M, G or T)", unit.trim())),
    };
    let size: bytesize::ByteSize =
        format!("{num} {unit}").parse().map_err(|_| format!("{s:?} is not a size like 512M or 16G"))?;
    if size.as_u64() == 0 {
        return Err(format!("{s:?} is not a positive size"));
    }
    // Sizes past an exbibyte are typos (and a saturated one would read as "everything").
    if size.as_u64() > 1 << 60 {
        return Err(format!("{s:?} is more than 1024 PiB"));
    }
    Ok(size.as_u64())
}

/// Where copies of checkpoints go: `s3://BUCKET[/PREFIX]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Url {
    /// The bucket.
    pub bucket: String,
    /// The key prefix (no leading or trailing slash; may be empty).
    pub prefix: String,
}

impl FromText for S3Url {
    fn from_text(s: &str) -> Result<S3Url, String> {
        let (bucket, prefix) = crate::remote::parse_url(s).map_err(|e| e.to_string())?;
        Ok(S3Url { bucket, prefix })
    }

    fn stand_in() -> S3Url {
        S3Url { bucket: String::new(), prefix: String::new() }
    }
}

impl<'de> Deserialize<'de> for S3Url {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<S3Url, D::Error> {
        read(d)
    }
}

/// How many pipeline stages: a number, or `"auto"` for the planner's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stages {
    /// Exactly this many stages per replica (at least 1).
    Fixed(usize),
    /// `"auto"`.
    Auto,
}

impl<'de> Deserialize<'de> for Stages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Stages, D::Error> {
        use serde_json::Value;
        let convert = |written: Value| match written {
            Value::Number(n) => match n.as_i64() {
                Some(k) if k >= 1 => {
                    usize::try_from(k).map(Stages::Fixed).map_err(|_| format!("{k} stages is too many"))
                }
                _ => Err(format!("{n} is not a positive number of stages (or \"auto\")")),
            },
            Value::String(w) if w == "auto" => Ok(Stages::Auto),
            Value::String(w) => Err(format!("{w:?} is neither a number nor \"auto\"")),
            other => Err(format!("{other} is neither a number of stages nor \"auto\"")),
        };
        read_as(d, convert, || Stages::Auto)
    }
}

#[cfg(feature = "trainer")]
impl FromText for limpet_trainer::device::DeviceChoice {
    fn from_text(s: &str) -> Result<Self, String> {
        Self::parse(s).map_err(|e| e.to_string())
    }

    fn stand_in() -> Self {
        Self::Cpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Section {
        #[serde(deserialize_with = "read")]
        addr: SocketAddr,
        #[serde(default, deserialize_with = "read_list")]
        seeds: Vec<SocketAddr>,
        #[serde(default)]
        size: Option<Bytes>,
        #[serde(default)]
        stages: Option<Stages>,
    }

    /// Inside `collect` every value that does not read is recorded, with the span of its own
    /// text, and the parse goes on; outside, the first one is the parse's error.
    #[test]
    fn every_bad_value_is_recorded_where_it_is_and_the_parse_goes_on() {
        let text = "addr = \"nowhere\"\nseeds = [\"1.2.3.4:5\", \"x:1\"]\nsize = \"lots\"\nstages = 0\n";
        let (parsed, unread) = collect(|| toml::from_str::<Section>(text));
        let parsed = parsed.unwrap();
        assert_eq!(parsed.addr, SocketAddr::stand_in());
        assert_eq!(parsed.seeds[0], "1.2.3.4:5".parse().unwrap());
        let at: Vec<&str> = unread.iter().map(|u| &text[u.span.clone()]).collect();
        assert_eq!(at, ["\"nowhere\"", "\"x:1\"", "\"lots\"", "0"]);
        assert!(unread[0].detail.contains("is not IP:PORT"), "{:?}", unread[0]);
        assert!(unread[2].detail.contains("unknown unit"), "{:?}", unread[2]);
        assert!(unread[3].detail.contains("not a positive number of stages"), "{:?}", unread[3]);

        let e = toml::from_str::<Section>(text).unwrap_err().to_string();
        assert!(e.contains("is not IP:PORT"), "{e}");
        let good = "addr = \"127.0.0.1:9\"\nsize = \"2K\"\nstages = \"auto\"\n";
        let (parsed, unread) = collect(|| toml::from_str::<Section>(good));
        assert!(unread.is_empty(), "{unread:?}");
        let parsed = parsed.unwrap();
        assert_eq!((parsed.size, parsed.stages), (Some(Bytes(2048)), Some(Stages::Auto)));
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(parse_bytes("16G"), Ok(16 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5K"), Ok(1536));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        for bad in ["-1G", "0", "12Q", "G", "2000000P"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        assert_eq!(Reserve::from_text("0"), Ok(Reserve(0)));
    }
}
