//! `strata-kvcache bench`: read bandwidth of the tiers against the disk's own, in one run.
//! Not part of CI. Writes `--total` bytes of `--block`-sized blocks through the real service
//! (a child process of this binary, over its Unix socket), then reads them back:
//! - L1: from RAM, over gRPC Fetch (the worker's path);
//! - L2: after a restart with the page cache dropped (root: /proc/sys/vm/drop_caches);
//! - raw: `dd` of a file of the same size in the same directory, page cache dropped too;
//! - placement: the same blocks as sled values vs files, cold, to justify where payloads live.
//!   It prints a table with ratios and the service's peak RSS (VmHWM).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use strata_proto::kvcache::{Block, FetchRequest, StatsRequest};

use crate::block::{BlockKey, make_block};
use crate::client::{CacheClient, Snapshots};

const NS: &str = "bench";

pub struct BenchArgs {
    pub dir: PathBuf,
    pub total_bytes: u64,
    pub block_bytes: u64,
}

fn blocks(args: &BenchArgs) -> Vec<Block> {
    // Layout: 1 layer, 1 head, head_dim 256 in f32 -> 2 KiB per token.
    let per_token = 2 * 256 * 4;
    let tokens = (args.block_bytes / per_token).max(1) as u32;
    let n = (args.total_bytes / (u64::from(tokens) * per_token)).max(1);
    let mut parent: Option<BlockKey> = None;
    (0..n)
        .map(|i| {
            let ids: Vec<u32> = (0..tokens).map(|t| i as u32 * tokens + t).collect();
            let payload: Vec<u8> = (0..u64::from(tokens) * per_token)
                .map(|b| (b.wrapping_mul(2_654_435_761) >> 13) as u8 ^ i as u8)
                .collect();
            let b = make_block(NS, parent.as_ref(), ids, (1, 1, 256, "float32"), payload);
            parent = b.header.as_ref().and_then(|h| BlockKey::from_slice(&h.key));
            b
        })
        .collect()
}

fn drop_caches() -> bool {
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

fn peak_rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn start(dir: &Path, ram: u64, disk: u64) -> anyhow::Result<(Child, PathBuf)> {
    let socket = dir.join("bench.sock");
    let child = Command::new(std::env::current_exe()?)
        .args([
            "serve",
            "--ram",
            &ram.to_string(),
            "--disk",
            &disk.to_string(),
            "--socket",
        ])
        .arg(&socket)
        .arg("--dir")
        .arg(dir.join("store"))
        .spawn()
        .context("start the service")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if Instant::now() > deadline {
            bail!("the service did not start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((child, socket))
}

fn stop(child: &mut Child) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

/// Reads every block back in chunks of 16, through the service (`file_reads` false: payloads
/// over gRPC) or the worker's client (`file_reads` true: disk-only blocks read from their
/// files by the client). Every block is verified either way.
async fn read_all(
    socket: &Path,
    keys: &[BlockKey],
    file_reads: bool,
) -> anyhow::Result<(u64, f64)> {
    let mut client = CacheClient::connect(socket, Duration::from_secs(5));
    let started = Instant::now();
    let mut bytes = 0u64;
    for chunk in keys.chunks(16) {
        if file_reads {
            let got = client
                .fetch_prefix(NS, chunk, Duration::from_secs(60), Snapshots::Every)
                .await?;
            if got.len() != chunk.len() {
                bail!("{} of {} blocks came back", got.len(), chunk.len());
            }
            bytes += got.iter().map(|b| b.payload.len() as u64).sum::<u64>();
        } else {
            let req = FetchRequest {
                namespace: NS.into(),
                keys: chunk.iter().map(|k| k.0.to_vec()).collect(),
                file_reads: false,
                snapshot_of_last_only: false,
            };
            let mut stream = client.rpc().fetch(req).await?.into_inner();
            while let Some(b) = stream.message().await? {
                crate::block::verify(&b)?;
                bytes += b.payload.len() as u64;
            }
        }
    }
    Ok((bytes, started.elapsed().as_secs_f64()))
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)?;
    let blocks = blocks(&args);
    let total: u64 = blocks.iter().map(|b| b.payload.len() as u64).sum();
    let keys: Vec<BlockKey> = blocks
        .iter()
        .filter_map(|b| b.header.as_ref().and_then(|h| BlockKey::from_slice(&h.key)))
        .collect();
    let ram = total + (256 << 20);
    let disk = total * 2 + (64 << 20);
    let gb = |bytes: u64, secs: f64| bytes as f64 / secs / 1e9;

    // Store through the service, wait for the disk writer, then read L1.
    let (mut child, socket) = start(&args.dir, ram, disk)?;
    let mut client = CacheClient::connect(&socket, Duration::from_secs(5));
    let t = Instant::now();
    for chunk in blocks.chunks(8) {
        client
            .rpc()
            .store(tokio_stream::iter(chunk.to_vec()))
            .await?;
    }
    let store_secs = t.elapsed().as_secs_f64();
    // Wait for the writer, so that L1 reads see blocks that are in RAM and on disk.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let stats = client.rpc().stats(StatsRequest {}).await?.into_inner();
        if stats.disk.is_some_and(|d| d.blocks >= keys.len() as u64) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the disk writer did not catch up");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (l1_bytes, l1_secs) = read_all(&socket, &keys, false).await?;
    let (l1f_bytes, l1f_secs) = read_all(&socket, &keys, true).await?;
    let rss_l1 = peak_rss_mb(child.id());
    stop(&mut child);

    // L2: a fresh process, cold page cache; first the service reading the files and sending
    // payloads over gRPC, then (cold again, fresh process) the client reading them itself.
    let dropped = drop_caches();
    let (mut child, socket) = start(&args.dir, ram, disk)?;
    let (l2_bytes, l2_secs) = read_all(&socket, &keys, false).await?;
    let rss_l2 = peak_rss_mb(child.id());
    stop(&mut child);
    drop_caches();
    let (mut child, socket) = start(&args.dir, ram, disk)?;
    let (l2d_bytes, l2d_secs) = read_all(&socket, &keys, true).await?;
    stop(&mut child);

    // Raw: dd of one file of the same size in the same directory.
    let raw = args.dir.join("raw.bin");
    let status = Command::new("dd")
        .args(["if=/dev/zero", &format!("of={}", raw.display()), "bs=4M"])
        .arg(format!("count={}", total.div_ceil(4 << 20)))
        .arg("conv=fsync")
        .stderr(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("dd could not write {}", raw.display());
    }
    drop_caches();
    let t = Instant::now();
    Command::new("dd")
        .args([&format!("if={}", raw.display()), "of=/dev/null", "bs=4M"])
        .stderr(std::process::Stdio::null())
        .status()?;
    let raw_secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&raw);

    // Placement: the same payloads read directly, cold: as block files (what L2 uses) ...
    drop_caches();
    let t = Instant::now();
    let mut file_bytes = 0u64;
    for key in &keys {
        let hex = key.hex();
        let path = args
            .dir
            .join("store/blocks")
            .join(&hex[..2])
            .join(format!("{hex}.blk"));
        file_bytes += std::fs::read(&path).map(|b| b.len() as u64).unwrap_or(0);
    }
    let file_secs = t.elapsed().as_secs_f64();

    // ... and as sled values.
    let sled_dir = args.dir.join("placement-sled");
    let _ = std::fs::remove_dir_all(&sled_dir);
    let db = sled::Config::new()
        .path(&sled_dir)
        .cache_capacity(16 << 20)
        .open()?;
    for (k, b) in keys.iter().zip(&blocks) {
        db.insert(k.0, b.payload.as_ref())?;
    }
    db.flush()?;
    drop(db);
    std::thread::sleep(Duration::from_millis(500));
    drop_caches();
    let db = sled::Config::new()
        .path(&sled_dir)
        .cache_capacity(16 << 20)
        .open()?;
    let t = Instant::now();
    let mut sled_bytes = 0u64;
    for k in &keys {
        sled_bytes += db.get(k.0)?.map(|v| v.len() as u64).unwrap_or(0);
    }
    let sled_secs = t.elapsed().as_secs_f64();
    drop(db);
    let _ = std::fs::remove_dir_all(&sled_dir);

    let raw_gb = gb(total, raw_secs);
    println!(
        "{} blocks of {:.1} MiB, {:.2} GB in all; page cache dropped: {}",
        blocks.len(),
        blocks[0].payload.len() as f64 / (1 << 20) as f64,
        total as f64 / 1e9,
        if dropped {
            "yes"
        } else {
            "no (not root): L2 and raw figures are warm"
        }
    );
    println!("{:<44} {:>8} {:>10}", "path", "GB/s", "vs raw dd");
    let row = |name: &str, v: f64| println!("{name:<44} {v:>8.2} {:>10.2}", v / raw_gb);
    row("store over gRPC (ack from RAM)", gb(total, store_secs));
    row("L1 read: RAM, payloads over gRPC", gb(l1_bytes, l1_secs));
    row(
        "L1 read: RAM, worker client (file, page cache)",
        gb(l1f_bytes, l1f_secs),
    );
    row(
        "L2 read: service reads files, gRPC, cold",
        gb(l2_bytes, l2_secs),
    );
    row(
        "L2 read: worker client reads files, cold",
        gb(l2d_bytes, l2d_secs),
    );
    row(
        "placement: block files read directly, cold",
        gb(file_bytes, file_secs),
    );
    row(
        "placement: sled values read directly, cold",
        gb(sled_bytes, sled_secs),
    );
    row("raw sequential read (dd bs=4M), cold", raw_gb);
    println!(
        "service peak RSS: {rss_l1:.0} MB with everything in L1 (--ram {} MB); {rss_l2:.0} MB reading from L2",
        ram >> 20
    );
    Ok(())
}
