//! An S3-compatible object store destination (AWS S3, MinIO, Ceph RGW, EOS's S3 gateway), through
//! the `object_store` crate. A copy is one multipart upload, which the store makes visible only
//! when it is complete: no partial object ever stands under the final key. The read-back is a
//! full GET, checksummed here; the store's own checksums are not trusted for the verification.

use std::io::{self, Read};

use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, WriteMultipart};

use crate::Destination;

/// Where and how to reach the store: `s3://bucket/prefix` with its endpoint and keys.
#[derive(Clone, Debug)]
pub struct S3Target {
    pub bucket: String,
    pub prefix: String,
    /// `http://127.0.0.1:9000` for a local store; `None`: AWS's for `region`.
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl S3Target {
    /// Parses `s3://bucket/prefix`; the rest comes from the environment's usual
    /// `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`.
    pub fn from_url_and_env(url: &str) -> Result<S3Target, String> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{url}: not an s3://bucket/prefix address"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("{url}: no bucket"));
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Ok(S3Target {
            bucket: bucket.into(),
            prefix: prefix.trim_matches('/').into(),
            endpoint: env("AWS_ENDPOINT_URL"),
            region: env("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
            access_key_id: env("AWS_ACCESS_KEY_ID")
                .ok_or_else(|| format!("{url}: AWS_ACCESS_KEY_ID is not set"))?,
            secret_access_key: env("AWS_SECRET_ACCESS_KEY")
                .ok_or_else(|| format!("{url}: AWS_SECRET_ACCESS_KEY is not set"))?,
        })
    }
}

pub struct S3Destination {
    target: S3Target,
    store: AmazonS3,
    rt: tokio::runtime::Runtime,
}

/// Bytes per part of an upload: S3 wants at least 5 MiB per part but the last.
const PART: usize = 8 << 20;

impl S3Destination {
    pub fn new(target: S3Target) -> io::Result<S3Destination> {
        // The shipper retries a failed copy itself, with its own backoff and a row in the run
        // database saying why: the client's own retries stay short, so that a store that is
        // down costs a pass seconds, not the client's default minutes per file.
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: std::time::Duration::from_millis(100),
                max_backoff: std::time::Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: 3,
            retry_timeout: std::time::Duration::from_secs(30),
        };
        let mut b = AmazonS3Builder::new()
            .with_retry(retry)
            .with_bucket_name(&target.bucket)
            .with_region(&target.region)
            .with_access_key_id(&target.access_key_id)
            .with_secret_access_key(&target.secret_access_key);
        if let Some(e) = &target.endpoint {
            // A site's own store: path-style addressing, plain HTTP allowed on its network.
            b = b
                .with_endpoint(e)
                .with_allow_http(e.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        let store = b.build().map_err(io::Error::other)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(S3Destination { target, store, rt })
    }

    fn key(&self, file: &str) -> ObjPath {
        if self.target.prefix.is_empty() {
            ObjPath::from(file)
        } else {
            ObjPath::from(format!("{}/{file}", self.target.prefix))
        }
    }
}

fn err(e: object_store::Error) -> io::Error {
    io::Error::other(e)
}

impl Destination for S3Destination {
    fn name(&self) -> String {
        if self.target.prefix.is_empty() {
            format!("s3://{}", self.target.bucket)
        } else {
            format!("s3://{}/{}", self.target.bucket, self.target.prefix)
        }
    }

    fn put(&self, file: &str, _size: u64, read: &mut dyn Read) -> io::Result<()> {
        let key = self.key(file);
        self.rt.block_on(async {
            let upload = self.store.put_multipart(&key).await.map_err(err)?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART);
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = match read.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = w.abort().await;
                        return Err(e);
                    }
                };
                if n == 0 {
                    break;
                }
                // Bounded: at most a few parts in flight at once.
                w.wait_for_capacity(2).await.map_err(err)?;
                w.write(&buf[..n]);
            }
            w.finish().await.map_err(err)?;
            Ok(())
        })
    }

    fn check(&self, file: &str) -> io::Result<Option<crate::Digest>> {
        let key = self.key(file);
        self.rt.block_on(async {
            let got = match self.store.get(&key).await {
                Ok(g) => g,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(err(e)),
            };
            let mut s = got.into_stream();
            let mut d = crate::Digester::default();
            while let Some(chunk) = s.next().await {
                d.update(&chunk.map_err(err)?);
            }
            Ok(Some(d.finish()))
        })
    }
}
