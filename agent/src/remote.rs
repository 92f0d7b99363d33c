//! A copy of the checkpoint directory in S3-compatible object storage (AWS S3, MinIO, Ceph,
//! GCS's S3 API), through the official SDK.
//!
//! Objects mirror the directory's layout under a prefix: `s3://BUCKET/PREFIX/step-N/blocks-A-B.limpet`.
//! Each part is uploaded after it was written and fsynced locally, and only then recorded in
//! the log; old steps are deleted like local ones. A new cluster whose directory has nothing
//! newer downloads the newest complete steps into its directory first, so the ordinary search
//! (which checks every part's checksum and job) decides what to resume from: a corrupt object
//! is skipped like a corrupt file.

use crate::checkpoint::{parse_part, parse_step_dir, part_path, CheckpointError};
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

    /// The URL of a part.
    pub fn url(&self, step: u64, blocks: &Range<usize>) -> String {
        format!("s3://{}/{}", self.bucket, self.key(&rel_of(step, blocks)))
    }

    /// Uploads the part at `path` (written and verified by `checkpoint`), tagged with its
    /// content hash and its job's fingerprint (`limpet_snapshot::job_fingerprint`), and checks
    /// the stored object's size and tags; its URL. Only tagged parts count as a checkpoint
    /// here, and only of the job they name (see `prune`).
    pub async fn upload(
        &self,
        step: u64,
        blocks: &Range<usize>,
        path: &Path,
        content_hash: &str,
        job: &str,
    ) -> Result<String, CheckpointError> {
        let key = self.key(&rel_of(step, blocks));
        let url = format!("s3://{}/{key}", self.bucket);
        let size = std::fs::metadata(path)
            .map_err(|source| CheckpointError::Io { op: "reading", path: path.to_path_buf(), source })?
            .len();
        let body = aws_sdk_s3::primitives::ByteStream::from_path(path).await.map_err(|e| {
            CheckpointError::Io { op: "reading", path: path.to_path_buf(), source: std::io::Error::other(e) }
        })?;
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(&key)
            .metadata(CONTENT_TAG, content_hash)
            .metadata(JOB_TAG, job)
            .body(body)
            .send()
            .await
            .map_err(|e| err("uploading to", &url, e))?;
        match self.verified(&key).await? {
            Some((len, tag, of)) if len == size && tag == content_hash && of == job => Ok(url),
            got => Err(CheckpointError::Bad {
                path: PathBuf::from(&url),
                detail: format!("stored as {got:?}, not the {size} bytes of {content_hash} uploaded"),
            }),
        }
    }

    /// A part's stored size, content tag and job tag (`None`: no content tag, so not a
    /// verified upload; an empty job tag: uploaded before parts named their job).
    async fn verified(&self, key: &str) -> Result<Option<(u64, String, String)>, CheckpointError> {
        let head = self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| err("checking", &format!("s3://{}/{key}", self.bucket), e))?;
        let tag = |k: &str| head.metadata().and_then(|m| m.get(k)).cloned();
        let job = tag(JOB_TAG).unwrap_or_default();
        Ok(tag(CONTENT_TAG).map(|t| (head.content_length().unwrap_or(0).max(0) as u64, t, job)))
    }

    /// Whether every part of `parts` that covers the model was a verified upload of `job`.
    async fn step_verified(
        &self,
        step: u64,
        parts: &[Range<usize>],
        blocks: usize,
        job: &str,
    ) -> Result<bool, CheckpointError> {
        let Some(chosen) = crate::checkpoint::cover(parts, blocks) else { return Ok(false) };
        for i in chosen {
            match self.verified(&self.key(&rel_of(step, &parts[i]))).await? {
                Some((_, _, of)) if of == job => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Whether every part of a step is tagged as `job`'s: only such steps are pruned.
    async fn step_of_job(
        &self,
        step: u64,
        parts: &[Range<usize>],
        job: &str,
    ) -> Result<bool, CheckpointError> {
        for b in parts {
            match self.verified(&self.key(&rel_of(step, b))).await? {
                Some((_, _, of)) if of == job => {}
                _ => return Ok(false),
            }
        }
        Ok(!parts.is_empty())
    }

    /// Every part under the prefix, by step (pages followed to the end); keys that are not
    /// ours are ignored.
    pub async fn list(&self) -> Result<BTreeMap<u64, Vec<Range<usize>>>, CheckpointError> {
        let prefix = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        let mut pages =
            self.client.list_objects_v2().bucket(&self.bucket).prefix(&prefix).into_paginator().send();
        let mut out: BTreeMap<u64, Vec<Range<usize>>> = BTreeMap::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| err("listing", &format!("s3://{}/{prefix}", self.bucket), e))?;
            for o in page.contents() {
                let Some(rel) = o.key().and_then(|k| k.strip_prefix(&prefix)) else { continue };
                let Some((d, f)) = rel.split_once('/') else { continue };
                if let (Some(step), Some(blocks)) = (parse_step_dir(d), parse_part(f)) {
                    out.entry(step).or_default().push(blocks);
                }
            }
        }
        Ok(out)
    }

    /// Downloads, into `dir`, the newest `want` steps whose parts cover `blocks` blocks and
    /// that `dir` does not hold yet (each part written atomically); the steps fetched.
    pub async fn fetch_newest(
        &self,
        dir: &Path,
        blocks: usize,
        want: usize,
    ) -> Result<Vec<u64>, CheckpointError> {
        let listed = self.list().await?;
        let mut fetched = Vec::new();
        for (&step, parts) in listed.iter().rev() {
            if fetched.len() >= want {
                break;
            }
            if !covers(parts, blocks) {
                continue;
            }
            for b in parts {
                let local = part_path(dir, step, b);
                if local.exists() {
                    continue;
                }
                let key = self.key(&rel_of(step, b));
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
            }
            fetched.push(step);
        }
        Ok(fetched)
    }

    /// Deletes every step of `job` (its fingerprint) older than the newest `keep` of that job
    /// that are verified uploads covering the model (names alone prove nothing: a part may be
    /// a stray copy), keeping newer steps, which may still be being written; with none
    /// verified, nothing. Another job's steps (a prefix reused by a new run), and parts that
    /// name no job, are neither counted nor deleted. The steps deleted.
    pub async fn prune(&self, keep: usize, blocks: usize, job: &str) -> Result<Vec<u64>, CheckpointError> {
        let listed = self.list().await?;
        let mut kept = Vec::new();
        for (&step, parts) in listed.iter().rev() {
            if kept.len() >= keep.max(1) {
                break;
            }
            if self.step_verified(step, parts, blocks, job).await? {
                kept.push(step);
            }
        }
        let Some(&oldest_kept) = kept.last() else { return Ok(Vec::new()) };
        let mut deleted = Vec::new();
        for (&step, parts) in listed.range(..oldest_kept) {
            if !self.step_of_job(step, parts, job).await? {
                continue;
            }
            for b in parts {
                let key = self.key(&rel_of(step, b));
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

fn rel_of(step: u64, blocks: &Range<usize>) -> String {
    let p = part_path(Path::new(""), step, blocks);
    p.to_string_lossy().into_owned()
}

/// Whether the parts tile `0..blocks` (going by the names).
fn covers(parts: &[Range<usize>], blocks: usize) -> bool {
    crate::checkpoint::cover(parts, blocks).is_some()
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
    fn coverage_needs_every_block_once() {
        assert!(covers(&[2..4, 0..2], 4));
        assert!(!covers(&[0..2, 2..3], 4));
        assert!(!covers(&[0..1, 2..4], 4));
        assert!(!covers(&[], 1));
    }
}
