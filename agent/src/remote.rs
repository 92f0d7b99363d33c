//! A copy of the checkpoint directory in S3-compatible object storage (AWS S3, MinIO, Ceph,
//! GCS's S3 API), through the official SDK.
//!
//! Objects mirror the directory's layout under a prefix: `s3://BUCKET/PREFIX/step-N/blocks-A-B.limpet`,
//! or `.../step-N/shard-I-of-W.limpet` for a sharded job's parts. Each part is uploaded after
//! it was written and fsynced locally, and a block part only then recorded in the log; a set
//! of shards is recorded by its local directory once every shard is in there, whatever its
//! copies' fate (a host's other shards are copied after it wrote them all, so the bucket may
//! lag the log; a failed copy counts as a checkpoint failure). Old steps are deleted like
//! local ones, counting only steps up to the one just written.
//! A new cluster whose directory has nothing newer downloads the newest complete steps into
//! its directory first, so the ordinary search (which checks every part's checksum and job)
//! decides what to resume from: a corrupt object is skipped like a corrupt file.

use crate::checkpoint::{cover, parse_step_dir, part_path, shard_path, CheckpointError, Listed};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Where checkpoints are copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteSettings {
    /// The bucket.
    pub bucket: String,
    /// The key prefix (no leading or trailing slash; may be empty).
    pub prefix: String,
    /// An S3-compatible endpoint (`http://minio:9000`), path-style; `None`: AWS's.
    pub endpoint: Option<String>,
    /// The region (`None`: the SDK's: environment, profile, instance metadata).
    pub region: Option<String>,
}

/// Parses `s3://BUCKET[/PREFIX]`.
pub fn parse_url(url: &str) -> Result<(String, String), CheckpointError> {
    let bad = |detail: String| CheckpointError::Url { url: url.to_string(), detail };
    let rest = url.strip_prefix("s3://").ok_or_else(|| bad("does not start with s3://".into()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let ok_bucket = (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !bucket.starts_with(['-', '.'])
        && !bucket.ends_with(['-', '.']);
    if !ok_bucket {
        return Err(bad(format!(
            "{bucket:?} is not a bucket name (3-63 lowercase letters, digits, '-', '.')"
        )));
    }
    let prefix = prefix.trim_matches('/');
    if prefix.split('/').any(|s| s == "." || s == "..") || prefix.contains("//") {
        return Err(bad(format!("prefix {prefix:?} has empty, '.' or '..' segments")));
    }
    Ok((bucket.to_string(), prefix.to_string()))
}

/// What a part of a checkpoint holds, as its name says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartName {
    /// Whole blocks of the model (`blocks-A-B.limpet`).
    Blocks(Range<usize>),
    /// Shard `index` of `of` of a sharded job's state (`shard-I-of-W.limpet`).
    Shard {
        /// Which shard.
        index: usize,
        /// Of how many.
        of: usize,
    },
}

impl PartName {
    /// The part's file in the checkpoint of `step` under `dir`.
    pub fn path(&self, dir: &Path, step: u64) -> PathBuf {
        match self {
            PartName::Blocks(blocks) => part_path(dir, step, blocks),
            PartName::Shard { index, of } => shard_path(dir, step, *index, *of),
        }
    }
}

/// What a stored object says of itself (`Remote::verified`).
#[derive(Debug)]
struct Stored {
    size: u64,
    /// The part's content hash.
    content: String,
    /// The job's fingerprint (empty: uploaded before parts named their job).
    job: String,
    /// The whole state's content hash a shard names (`None`: a block part).
    whole: Option<String>,
}

/// A connected copy.
#[derive(Clone)]
pub struct Remote {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
}

fn err<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    op: &'static str,
    what: &str,
    e: aws_sdk_s3::error::SdkError<E>,
) -> CheckpointError {
    let detail = match e.as_service_error().and_then(|s| s.code().map(|c| (c.to_string(), s.message()))) {
        Some((code, msg)) => format!("{code}: {}", msg.unwrap_or("")),
        None => DisplayErrorContext(&e).to_string(),
    };
    CheckpointError::Io { op, path: PathBuf::from(what), source: std::io::Error::other(detail) }
}

impl Remote {
    /// Builds the client (no request is made).
    pub async fn connect(s: &RemoteSettings) -> Remote {
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        if let Some(r) = &s.region {
            loader = loader.region(aws_sdk_s3::config::Region::new(r.clone()));
        }
        let shared = loader.load().await;
        let mut b = aws_sdk_s3::config::Builder::from(&shared);
        if shared.region().is_none() {
            // S3 signs with a region even where the store ignores it.
            b = b.region(aws_sdk_s3::config::Region::new("us-east-1"));
        }
        if let Some(url) = &s.endpoint {
            // S3-compatible stores address buckets by path, not by host name.
            b = b.endpoint_url(url).force_path_style(true);
        }
        Remote {
            client: aws_sdk_s3::Client::from_conf(b.build()),
            bucket: s.bucket.clone(),
            prefix: s.prefix.clone(),
        }
    }

    /// Uses a client configured elsewhere (tools, tests).
    pub fn with_client(client: aws_sdk_s3::Client, s: &RemoteSettings) -> Remote {
        Remote { client, bucket: s.bucket.clone(), prefix: s.prefix.clone() }
    }

    fn key(&self, rel: &str) -> String {
        if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }

    /// The key of an object `list` named by its path under the prefix.
    fn key_of(&self, rel: &Path) -> String {
        self.key(&rel.to_string_lossy())
    }

    /// The URL of a part.
    pub fn url(&self, step: u64, name: &PartName) -> String {
        format!("s3://{}/{}", self.bucket, self.key(&rel_of(step, name)))
    }

    /// Uploads the part at `path` (written and verified by `checkpoint`), tagged with its
    /// content hash, its job's fingerprint (`limpet_snapshot::job_fingerprint`) and, for a
    /// shard, the content hash of the whole state its set joins into (`whole`), and checks
    /// the stored object's size and tags; its URL. Only tagged parts count as a checkpoint
    /// here, only of the job they name, and shards only as a whole set naming one state (see
    /// `prune`).
    pub async fn upload(
        &self,
        step: u64,
        name: &PartName,
        path: &Path,
        content_hash: &str,
        job: &str,
        whole: Option<&str>,
    ) -> Result<String, CheckpointError> {
        let key = self.key(&rel_of(step, name));
        let url = format!("s3://{}/{key}", self.bucket);
        let size = std::fs::metadata(path)
            .map_err(|source| CheckpointError::Io { op: "reading", path: path.to_path_buf(), source })?
            .len();
        let body = aws_sdk_s3::primitives::ByteStream::from_path(path).await.map_err(|e| {
            CheckpointError::Io { op: "reading", path: path.to_path_buf(), source: std::io::Error::other(e) }
        })?;
        let mut put = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&key)
            .metadata(CONTENT_TAG, content_hash)
            .metadata(JOB_TAG, job);
        if let Some(w) = whole {
            put = put.metadata(WHOLE_TAG, w);
        }
        put.body(body).send().await.map_err(|e| err("uploading to", &url, e))?;
        match self.verified(&key).await? {
            Some(s)
                if s.size == size
                    && s.content == content_hash
                    && s.job == job
                    && s.whole.as_deref() == whole =>
            {
                Ok(url)
            }
            got => Err(CheckpointError::Bad {
                path: PathBuf::from(&url),
                detail: format!("stored as {got:?}, not the {size} bytes of {content_hash} uploaded"),
            }),
        }
    }

    /// What a part's object says of itself: its size and tags (`None`: no content tag, so
    /// not a verified upload).
    async fn verified(&self, key: &str) -> Result<Option<Stored>, CheckpointError> {
        let head = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| err("checking", &format!("s3://{}/{key}", self.bucket), e))?;
        let tag = |k: &str| head.metadata().and_then(|m| m.get(k)).cloned();
        Ok(tag(CONTENT_TAG).map(|content| Stored {
            size: head.content_length().unwrap_or(0).max(0) as u64,
            content,
            job: tag(JOB_TAG).unwrap_or_default(),
            whole: tag(WHOLE_TAG),
        }))
    }

    /// The whole sets of shards of `l` (`Listed::shard_sets`, largest first) that pass
    /// [`Remote::verified_set`]: each shard's object under the prefix and local path under
    /// `dir`. A step can hold two, each whole by its tags (two worlds wrote the step); one
    /// may still not make its state once its headers are read.
    async fn shard_sets(
        &self,
        l: &Listed,
        dir: &Path,
        job: &str,
    ) -> Result<Vec<Vec<(PathBuf, PathBuf)>>, CheckpointError> {
        let mut sets = Vec::new();
        for files in l.shard_sets() {
            if let Some(set) = self.verified_set(l, files, dir, job).await? {
                sets.push(set);
            }
        }
        Ok(sets)
    }

    /// The whole set of shards `files` of `l`, each its object under the prefix and local
    /// path under `dir`, if every one is a verified upload of `job` and all name one whole
    /// state: a set whose names are complete may still mix shards of two writes of the step
    /// (one going on as training came back to the step), or hold a stray copy.
    async fn verified_set(
        &self,
        l: &Listed,
        files: Vec<PathBuf>,
        dir: &Path,
        job: &str,
    ) -> Result<Option<Vec<(PathBuf, PathBuf)>>, CheckpointError> {
        let mut whole: Option<String> = None;
        let mut set = Vec::with_capacity(files.len());
        for rel in files {
            let Some(s) = self.verified(&self.key_of(&rel)).await? else { return Ok(None) };
            let (Some(w), true) = (s.whole, s.job == job) else { return Ok(None) };
            if *whole.get_or_insert_with(|| w.clone()) != w {
                return Ok(None);
            }
            let Some(&(_, index, of)) = l.shards.iter().find(|s| s.0 == rel) else { return Ok(None) };
            set.push((rel, shard_path(dir, l.step, index, of)));
        }
        Ok(Some(set))
    }

    /// Whether the parts of step `l` that cover the model were verified uploads of `job`, or
    /// it holds a whole set of shards that were (`verified_set`).
    async fn step_verified(&self, l: &Listed, blocks: usize, job: &str) -> Result<bool, CheckpointError> {
        if let Some(chosen) = cover(&ranges(l), blocks) {
            let mut all = true;
            for i in chosen {
                match self.verified(&self.key_of(&l.parts[i].0)).await? {
                    Some(s) if s.job == job => {}
                    _ => {
                        all = false;
                        break;
                    }
                }
            }
            if all {
                return Ok(true);
            }
        }
        for files in l.shard_sets() {
            if self.verified_set(l, files, Path::new(""), job).await?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Whether every object of a step is tagged as `job`'s: only such steps are pruned.
    async fn step_of_job(&self, l: &Listed, job: &str) -> Result<bool, CheckpointError> {
        for rel in l.files() {
            match self.verified(&self.key_of(rel)).await? {
                Some(s) if s.job == job => {}
                _ => return Ok(false),
            }
        }
        Ok(l.files().next().is_some())
    }

    /// Every step under the prefix with its parts and shards (each named by its path under
    /// the prefix, `step-N/...`; pages followed to the end); keys that are not ours are
    /// ignored.
    pub async fn list(&self) -> Result<BTreeMap<u64, Listed>, CheckpointError> {
        let prefix = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        let mut pages =
            self.client.list_objects_v2().bucket(&self.bucket).prefix(&prefix).into_paginator().send();
        let mut names: BTreeMap<u64, Vec<PathBuf>> = BTreeMap::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| err("listing", &format!("s3://{}/{prefix}", self.bucket), e))?;
            for o in page.contents() {
                let Some(rel) = o.key().and_then(|k| k.strip_prefix(&prefix)) else { continue };
                let Some((d, f)) = rel.split_once('/') else { continue };
                // A part sits right in its step's directory, never deeper.
                if let (Some(step), false) = (parse_step_dir(d), f.contains('/')) {
                    names.entry(step).or_default().push(PathBuf::from(rel));
                }
            }
        }
        Ok(names
            .into_iter()
            .map(|(step, files)| (step, Listed::of_files(step, files)))
            .filter(|(_, l)| l.files().next().is_some())
            .collect())
    }

    /// Downloads, into `dir`, the newest `want` steps that `dir` does not hold yet and whose
    /// parts cover `blocks` blocks (by their names: the local search checks each part's
    /// content and job), or that hold a whole set of shards uploaded by `job` (its
    /// fingerprint) naming one whole state (`verified_set`) whose headers, once here, agree
    /// on it (a set whose tags lie, or that meets a stale local file, is passed over for the
    /// step's next set, of fewer shards, then for an older step): each file written
    /// atomically; the steps fetched.
    pub async fn fetch_newest(
        &self,
        dir: &Path,
        blocks: usize,
        job: &str,
        want: usize,
    ) -> Result<Vec<u64>, CheckpointError> {
        let listed = self.list().await?;
        let mut fetched = Vec::new();
        for (&step, l) in listed.iter().rev() {
            if fetched.len() >= want {
                break;
            }
            let candidates: Vec<(Vec<(PathBuf, PathBuf)>, bool)> = if covers(&ranges(l), blocks) {
                vec![(l.parts.iter().map(|(rel, b)| (rel.clone(), part_path(dir, step, b))).collect(), false)]
            } else {
                self.shard_sets(l, dir, job).await?.into_iter().map(|set| (set, true)).collect()
            };
            for (files, shards) in candidates {
                if self.bring(step, files, shards).await? {
                    fetched.push(step);
                    break;
                }
            }
        }
        Ok(fetched)
    }

    /// Downloads `files` of `step` (each object under the prefix to its local path, unless
    /// that exists); for a set of shards, checks their headers make one state of the step,
    /// and when they do not, removes what it brought and says false.
    async fn bring(
        &self,
        step: u64,
        files: Vec<(PathBuf, PathBuf)>,
        shards: bool,
    ) -> Result<bool, CheckpointError> {
        let locals: Vec<PathBuf> = files.iter().map(|(_, local)| local.clone()).collect();
        let mut downloaded = Vec::new();
        for (rel, local) in files {
            if local.exists() {
                continue;
            }
            let key = self.key_of(&rel);
            let url = format!("s3://{}/{key}", self.bucket);
            let obj = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(&key)
                .send()
                .await
                .map_err(|e| err("downloading", &url, e))?;
            let bytes = obj.body.collect().await.map_err(|e| CheckpointError::Io {
                op: "downloading",
                path: PathBuf::from(&url),
                source: std::io::Error::other(e),
            })?;
            write_atomically(&local, &bytes.into_bytes())?;
            downloaded.push(local);
        }
        if !shards {
            return Ok(true);
        }
        // Tags are what the uploader said: the headers are what the set holds.
        let why = match crate::checkpoint::shards_agree(&locals) {
            Ok((at, _, _)) if at == step => return Ok(true),
            Ok((at, _, _)) => format!("it holds step {at}"),
            Err(e) => e.to_string(),
        };
        // What was brought here of a set passed over goes again (the local search would
        // only pass it over too).
        tracing::warn!(step, shards = locals.len(), %why, "a set of shards in S3 does not make one state here; passed over");
        for f in &downloaded {
            let _ = std::fs::remove_file(f);
        }
        if let Some(d) = downloaded.first().and_then(|f| f.parent()) {
            let _ = std::fs::remove_dir(d);
        }
        Ok(false)
    }

    /// Deletes every step of `job` (its fingerprint) older than the newest `keep` of that job
    /// that are verified uploads covering the model or making a whole set of shards (names
    /// alone prove nothing: a part may be a stray copy, a set may mix two writes), keeping
    /// newer steps, which may still be being written; with none verified, nothing. Another
    /// job's steps (a prefix reused by a new run), and parts that name no job, are neither
    /// counted nor deleted. Only steps up to `upto` (the one just written) count: a later
    /// one is another run's or an abandoned timeline's, and must not push the step being
    /// written out. The steps deleted (each with every object of it).
    pub async fn prune(
        &self,
        keep: usize,
        blocks: usize,
        job: &str,
        upto: u64,
    ) -> Result<Vec<u64>, CheckpointError> {
        let listed = self.list().await?;
        let mut kept = Vec::new();
        for (&step, l) in listed.range(..=upto).rev() {
            if kept.len() >= keep.max(1) {
                break;
            }
            if self.step_verified(l, blocks, job).await? {
                kept.push(step);
            }
        }
        let Some(&oldest_kept) = kept.last() else { return Ok(Vec::new()) };
        let mut deleted = Vec::new();
        for (&step, l) in listed.range(..oldest_kept) {
            if !self.step_of_job(l, job).await? {
                continue;
            }
            for rel in l.files() {
                let key = self.key_of(rel);
                self.client
                    .delete_object()
                    .bucket(&self.bucket)
                    .key(&key)
                    .send()
                    .await
                    .map_err(|e| err("deleting", &format!("s3://{}/{key}", self.bucket), e))?;
            }
            deleted.push(step);
        }
        Ok(deleted)
    }
}

/// The S3 user metadata that marks a verified upload: the part's content hash.
const CONTENT_TAG: &str = "limpet-content";
/// The S3 user metadata naming the job a part belongs to (`limpet_snapshot::job_fingerprint`).
const JOB_TAG: &str = "limpet-job";
/// The S3 user metadata of a shard naming the content hash of the whole state its set joins
/// into: a set counts only if every shard names the same.
const WHOLE_TAG: &str = "limpet-whole";

fn rel_of(step: u64, name: &PartName) -> String {
    name.path(Path::new(""), step).to_string_lossy().into_owned()
}

/// The block ranges of a step's parts.
fn ranges(l: &Listed) -> Vec<Range<usize>> {
    l.parts.iter().map(|(_, r)| r.clone()).collect()
}

/// Whether the parts tile `0..blocks` (going by the names).
fn covers(parts: &[Range<usize>], blocks: usize) -> bool {
    cover(parts, blocks).is_some()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let io = |op: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| CheckpointError::Io { op, path: p, source }
    };
    let parent = path.parent().expect("a part has a step directory");
    std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
    let tmp = path.with_extension("download");
    std::fs::write(&tmp, bytes).map_err(io("writing", &tmp))?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io("syncing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("renaming", &tmp))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_are_named() {
        assert_eq!(parse_url("s3://my-bucket/runs/a").unwrap(), ("my-bucket".into(), "runs/a".into()));
        assert_eq!(parse_url("s3://my-bucket").unwrap(), ("my-bucket".into(), String::new()));
        assert_eq!(parse_url("s3://my-bucket/x/").unwrap(), ("my-bucket".into(), "x".into()));
        for bad in
            ["http://b/x", "s3://", "s3://B", "s3://ab", "s3://b_b/x", "s3://bucket/a//b", "s3://bucket/../x"]
        {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parts_and_shards_are_named_as_on_disk() {
        assert_eq!(rel_of(12, &PartName::Blocks(0..4)), "step-000000000012/blocks-0-4.limpet");
        assert_eq!(rel_of(12, &PartName::Shard { index: 1, of: 3 }), "step-000000000012/shard-1-of-3.limpet");
        let files = ["step-000000000012/shard-1-of-3.limpet", "step-000000000012/blocks-0-4.limpet", "x"];
        let l = Listed::of_files(12, files.map(PathBuf::from));
        assert_eq!((l.parts.len(), l.shards.len()), (1, 1));
    }

    #[test]
    fn coverage_needs_every_block_once() {
        assert!(covers(&[2..4, 0..2], 4));
        assert!(!covers(&[0..2, 2..3], 4));
        assert!(!covers(&[0..1, 2..4], 4));
        assert!(!covers(&[], 1));
    }
}
