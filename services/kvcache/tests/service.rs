//! The real `strata-kvcache` binary over a real Unix socket: store, look up and fetch blocks;
//! stop and restart (blocks come back from disk); a corrupted file is a counted miss; and
//! 20 rounds of kill -9 during heavy writes, after which every block served is byte-for-byte
//! what was written.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use strata_kvcache::block::{BlockKey, make_block, make_block_of, with_recurrent_state};
use strata_kvcache::client::{CacheClient, Snapshots};
use strata_proto::kvcache::kv_cache_client::KvCacheClient;
use strata_proto::kvcache::{
    Block, FetchRequest, LookupRequest, ReportRequest, StatsRequest, StatsResponse, Tier,
};
use tonic::transport::Channel;

const NS: &str = "model-fingerprint-for-tests";
const LAYOUT: (u32, u32, u32, &str) = (4, 2, 32, "float32");
const TOKENS_PER_BLOCK: u32 = 16;

/// Block `i` of one long chain: deterministic tokens and payload, so any reader can check it.
fn chain(n: usize) -> Vec<Block> {
    let mut parent: Option<BlockKey> = None;
    (0..n)
        .map(|i| {
            let tokens: Vec<u32> = (0..TOKENS_PER_BLOCK).map(|t| i as u32 * 1000 + t).collect();
            let bytes = 2 * LAYOUT.0 * LAYOUT.1 * LAYOUT.2 * 4 * TOKENS_PER_BLOCK;
            let payload: Vec<u8> = (0..bytes)
                .map(|b| (b as usize * 31 + i * 7) as u8)
                .collect();
            let block = make_block(NS, parent.as_ref(), tokens, LAYOUT, payload);
            parent = BlockKey::from_slice(&block.header.as_ref().unwrap().key);
            block
        })
        .collect()
}

fn key(b: &Block) -> Vec<u8> {
    b.header.as_ref().unwrap().key.clone()
}

struct Service {
    child: Child,
    socket: PathBuf,
}

/// A test that fails must not leave its service running.
impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Service {
    fn start(dir: &Path) -> Self {
        Self::start_with(dir, &[])
    }

    fn start_with(dir: &Path, extra: &[&str]) -> Self {
        let socket = dir.join("kv.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata-kvcache"))
            .arg("serve")
            .args(if extra.contains(&"--ram") {
                &[][..]
            } else {
                &["--ram", "8MiB"]
            })
            .args(if extra.contains(&"--disk") {
                &[][..]
            } else {
                &["--disk", "64MiB"]
            })
            .args(extra)
            .arg("--socket")
            .arg(&socket)
            .arg("--dir")
            .arg(dir.join("store"))
            .spawn()
            .expect("start strata-kvcache");
        // The socket file of a killed predecessor may still be there: wait for a live answer.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(child.try_wait().unwrap().is_none(), "strata-kvcache exited");
            assert!(Instant::now() < deadline, "socket did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, socket }
    }

    fn client(&self) -> KvCacheClient<Channel> {
        KvCacheClient::new(strata_runtime::uds::channel(
            &self.socket,
            Duration::from_secs(2),
        ))
    }

    fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "exit status {status}");
    }

    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

async fn store(client: &mut KvCacheClient<Channel>, blocks: Vec<Block>) -> u32 {
    client
        .store(tokio_stream::iter(blocks))
        .await
        .map(|r| r.into_inner().accepted)
        .unwrap_or(0)
}

async fn lookup(client: &mut KvCacheClient<Channel>, blocks: &[Block]) -> Vec<Tier> {
    let req = LookupRequest {
        namespace: NS.into(),
        keys: blocks.iter().map(key).collect(),
        ..Default::default()
    };
    client
        .lookup(req)
        .await
        .unwrap()
        .into_inner()
        .blocks
        .iter()
        .map(|b| Tier::try_from(b.tier).unwrap())
        .collect()
}

async fn fetch(
    client: &mut KvCacheClient<Channel>,
    blocks: &[Block],
) -> Vec<Result<Block, tonic::Status>> {
    fetch_in(client, NS, blocks).await
}

async fn fetch_in(
    client: &mut KvCacheClient<Channel>,
    namespace: &str,
    blocks: &[Block],
) -> Vec<Result<Block, tonic::Status>> {
    let req = FetchRequest {
        namespace: namespace.into(),
        keys: blocks.iter().map(key).collect(),
        file_reads: false,
        snapshot_of_last_only: false,
    };
    let mut stream = client.fetch(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(b)) => out.push(Ok(b)),
            Ok(None) => break,
            Err(s) => {
                out.push(Err(s));
                break;
            }
        }
    }
    out
}

#[tokio::test]
async fn blocks_are_served_from_ram_then_from_disk_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = chain(24);
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    assert_eq!(store(&mut c, blocks.clone()).await, 24);
    assert_eq!(lookup(&mut c, &blocks).await, vec![Tier::Ram; 24]);
    let got: Vec<Block> = fetch(&mut c, &blocks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got, blocks);

    // A lying block is refused, and never served.
    let mut bad = chain(25).pop().unwrap();
    let mut payload = bad.payload.to_vec();
    payload[0] ^= 1;
    bad.payload = payload.into();
    let r = c
        .store(tokio_stream::iter(vec![bad.clone()]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.accepted, r.refused), (0, 1));
    assert!(r.refusals[0].contains("checksum"), "{:?}", r.refusals);
    svc.stop();

    let svc = Service::start(dir.path());
    let mut c = svc.client();
    assert_eq!(lookup(&mut c, &blocks).await, vec![Tier::Disk; 24]);
    let got: Vec<Block> = fetch(&mut c, &blocks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got, blocks);
    let stats = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.disk.unwrap().hits, 24);

    // Corrupt one block file behind the service's back: it becomes a counted miss.
    svc.stop();
    let victim = BlockKey::from_slice(&key(&blocks[3])).unwrap().hex();
    let path = dir
        .path()
        .join("store/blocks")
        .join(&victim[..2])
        .join(format!("{victim}.blk"));
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0x55;
    std::fs::write(&path, bytes).unwrap();
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    let got = fetch(&mut c, &blocks[3..4]).await;
    assert_eq!(got[0].as_ref().unwrap_err().code(), tonic::Code::NotFound);
    let stats = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.corrupt_blocks, 1);
    // The chain is now held only up to the hole.
    assert_eq!(lookup(&mut c, &blocks).await.len(), 3);
    svc.stop();
}

#[tokio::test]
async fn after_kill_9_during_heavy_writes_every_served_block_is_intact() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = chain(64);
    let mut verified = 0;
    for round in 0..20u64 {
        let svc = Service::start(dir.path());
        let mut c = svc.client();
        // Everything the store now claims to hold must be exactly what was written.
        let held = lookup(&mut c, &blocks).await.len();
        for (i, got) in fetch(&mut c, &blocks[..held]).await.into_iter().enumerate() {
            match got {
                Ok(b) => {
                    assert_eq!(b, blocks[i], "round {round}: block {i} differs");
                    verified += 1;
                }
                // A block whose file was torn by the kill is dropped at read: a miss, never a
                // wrong block.
                Err(s) => assert_eq!(s.code(), tonic::Code::NotFound, "round {round}: {s}"),
            }
        }
        // Heavy writes, killed part-way through.
        let writer = tokio::spawn(async move {
            for chunk in blocks_owned(64).chunks(8) {
                store(&mut c, chunk.to_vec()).await;
            }
        });
        tokio::time::sleep(Duration::from_millis(20 + (round * 37) % 120)).await;
        svc.kill9();
        let _ = writer.await;
    }
    // The loop must have exercised recovery, not just empty stores.
    assert!(
        verified > 100,
        "only {verified} blocks came back across the rounds"
    );
}

fn blocks_owned(n: usize) -> Vec<Block> {
    chain(n)
}

#[tokio::test]
async fn once_the_daily_write_budget_is_spent_blocks_stay_in_ram_and_stats_say_so() {
    let dir = tempfile::tempdir().unwrap();
    // Each test block is about 32 KiB on disk: a 100 KiB budget takes three of them.
    let svc = Service::start_with(dir.path(), &["--disk-write-budget", "100KiB"]);
    let mut c = svc.client();
    let blocks = chain(8);
    assert_eq!(
        store(&mut c, blocks.clone()).await,
        8,
        "all accepted into RAM"
    );
    // The writer runs behind the acknowledgement: wait until it has dealt with all eight.
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
        if s.disk.as_ref().unwrap().blocks + s.blocks_ram_only_budget_spent == 8 {
            break s;
        }
        assert!(Instant::now() < deadline, "writer did not finish: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(stats.disk.unwrap().blocks, 3);
    assert_eq!(stats.blocks_ram_only_budget_spent, 5);
    assert_eq!(stats.disk_write_budget_bytes, 100 * 1024);
    assert!(stats.disk_write_budget_left < 32 * 1024);
    assert!(stats.disk_bytes_written_today <= 100 * 1024);
    // Every block is still served (from RAM).
    assert_eq!(lookup(&mut c, &blocks).await.len(), 8);
    svc.stop();
}

#[tokio::test]
async fn bad_input_gets_clear_statuses_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    let blocks = chain(2);
    assert_eq!(store(&mut c, blocks.clone()).await, 2);

    // A key that is not 32 bytes.
    let err = c
        .lookup(LookupRequest {
            namespace: NS.into(),
            keys: vec![vec![1, 2, 3]],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("32 bytes"), "{}", err.message());
    // Fetch without a namespace.
    let err = c
        .fetch(FetchRequest {
            namespace: String::new(),
            keys: vec![key(&blocks[0])],
            file_reads: false,
            snapshot_of_last_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Another model's namespace never sees these blocks.
    let req = FetchRequest {
        namespace: "another-model".into(),
        keys: vec![key(&blocks[0])],
        file_reads: false,
        snapshot_of_last_only: false,
    };
    let mut stream = c.fetch(req).await.unwrap().into_inner();
    assert_eq!(
        stream.message().await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    // A block without a header, and one whose key lies about its tokens: refused with reasons.
    let mut liar = blocks[1].clone();
    liar.header.as_mut().unwrap().token_ids.reverse();
    let headless = Block {
        header: None,
        payload: vec![0; 16].into(),
        file: None,
    };
    let r = c
        .store(tokio_stream::iter(vec![headless, liar]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.accepted, r.refused), (0, 2));
    assert!(r.refusals[0].contains("header"), "{:?}", r.refusals);
    assert!(r.refusals[1].contains("key"), "{:?}", r.refusals);
    // Nothing changed: the good blocks are still served as they were.
    let got: Vec<Block> = fetch(&mut c, &blocks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got, blocks);
    let stats = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.stores_refused, 2);
    svc.stop();
}

#[test]
fn a_dir_that_cannot_be_created_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-kvcache"))
        .args(["serve", "--socket"])
        .arg(dir.path().join("kv.sock"))
        .arg("--dir")
        .arg(file.join("store"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not-a-dir/store"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A Lookup of `keys` with the prompt's tokens, by the block-granular rule or by common prefix.
fn lookup_tokens(
    c: &mut KvCacheClient<Channel>,
    keys: Vec<Vec<u8>>,
    tokens: Vec<u32>,
    common_prefix: bool,
) -> impl std::future::Future<Output = strata_proto::kvcache::LookupResponse> + use<> {
    let mut c = c.clone();
    async move {
        c.lookup(LookupRequest {
            namespace: NS.into(),
            keys,
            prompt_tokens: tokens,
            block_tokens: TOKENS_PER_BLOCK,
            common_prefix,
        })
        .await
        .unwrap()
        .into_inner()
    }
}

/// At token granularity any block under the held prefix, full or partial, continues it by
/// its longest common prefix with the prompt, from RAM and from the disk index after a restart.
#[tokio::test]
async fn blocks_continue_a_prefix_by_their_longest_common_prefix_at_token_granularity() {
    let dir = tempfile::tempdir().unwrap();
    let full = chain(3);
    let branch = tail_block(&full[..1], vec![1000, 1001, 1002, 5, 6]);
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    let all = vec![
        full[0].clone(),
        full[1].clone(),
        full[2].clone(),
        branch.clone(),
    ];
    assert_eq!(store(&mut c, all).await, 4);
    continuations_by_common_prefix(&mut c, &full, &branch).await;
    svc.stop();
    // After a restart the same blocks are found through the disk index.
    let svc = Service::start(dir.path());
    continuations_by_common_prefix(&mut svc.client(), &full, &branch).await;
    svc.stop();
}

async fn continuations_by_common_prefix(
    c: &mut KvCacheClient<Channel>,
    full: &[Block],
    branch: &Block,
) {
    let tokens_of = |b: &Block| b.header.as_ref().unwrap().token_ids.clone();
    // The prompt holds block 0, then 10 tokens of block 1, then parts from it.
    let mut prompt = tokens_of(&full[0]);
    prompt.extend_from_slice(&tokens_of(&full[1])[..10]);
    prompt.extend_from_slice(&[424242; 20]);
    let keys: Vec<Vec<u8>> = vec![key(&full[0]), vec![7; 32]];
    let r = lookup_tokens(c, keys.clone(), prompt.clone(), true).await;
    assert_eq!(r.blocks.len(), 1);
    let found = r.partial.as_ref().map(|p| p.key.clone());
    assert_eq!((r.partial_tokens, found), (10, Some(key(&full[1]))));
    // The block-granular rule takes no full block's rows, nor a partial block that does not
    // start the rest whole.
    let r = lookup_tokens(c, keys.clone(), prompt, false).await;
    assert!(r.partial.is_none(), "{r:?}");
    // Two branches of one prefix are both held: the one sharing more wins.
    let mut other = tokens_of(&full[0]);
    other.extend_from_slice(&[1000, 1001, 1002, 5, 9, 9]);
    let r = lookup_tokens(c, keys, other, true).await;
    let found = r.partial.as_ref().map(|p| p.key.clone());
    assert_eq!((r.partial_tokens, found), (4, Some(key(branch))));
}

/// A partial block of `n` tokens continuing `blocks`, as a worker stores a prompt's tail.
fn tail_block(blocks: &[Block], tokens: Vec<u32>) -> Block {
    let parent = blocks.last().and_then(|b| BlockKey::from_slice(&key(b)));
    let bytes = 2 * LAYOUT.0 * LAYOUT.1 * LAYOUT.2 * 4 * tokens.len() as u32;
    let payload: Vec<u8> = (0..bytes)
        .map(|b| (b as usize * 13 + tokens.len()) as u8)
        .collect();
    make_block_of(
        NS,
        parent.as_ref(),
        tokens,
        TOKENS_PER_BLOCK,
        LAYOUT,
        payload,
    )
}

#[tokio::test]
async fn partial_tail_blocks_are_found_by_prefix_under_their_parent_even_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let full = chain(2);
    let tail5: Vec<u32> = vec![7001, 7002, 7003, 7004, 7005];
    let tail3: Vec<u32> = tail5[..3].to_vec();
    let partial5 = tail_block(&full, tail5.clone());
    let partial3 = tail_block(&full, tail3);
    let root_partial = tail_block(&[], vec![1, 2]);

    let prompt = |extra: &[u32]| -> Vec<u32> {
        let mut p: Vec<u32> = full
            .iter()
            .flat_map(|b| b.header.as_ref().unwrap().token_ids.clone())
            .collect();
        p.extend_from_slice(extra);
        p
    };
    let ask = |c: &mut KvCacheClient<Channel>, keys: Vec<Vec<u8>>, tokens: Vec<u32>| {
        lookup_tokens(c, keys, tokens, false)
    };

    let svc = Service::start(dir.path());
    let mut c = svc.client();
    let all = vec![
        full[0].clone(),
        full[1].clone(),
        partial5.clone(),
        partial3,
        root_partial.clone(),
    ];
    assert_eq!(store(&mut c, all).await, 5);

    // The prompt continues with the five tail tokens and more: the longest match wins.
    let keys: Vec<Vec<u8>> = full.iter().map(key).collect();
    let r = ask(
        &mut c,
        keys.clone(),
        prompt(&[7001, 7002, 7003, 7004, 7005, 9, 9]),
    )
    .await;
    assert_eq!(r.blocks.len(), 2);
    assert_eq!(r.partial_tokens, 5);
    assert_eq!(r.partial.as_ref().unwrap().key, key(&partial5));
    // Only the first three tokens agree: the three-token partial block is the match.
    let r = ask(&mut c, keys.clone(), prompt(&[7001, 7002, 7003, 8000])).await;
    assert_eq!(r.partial_tokens, 3);
    // Diverging at once: no partial block.
    let r = ask(&mut c, keys.clone(), prompt(&[1, 2, 3])).await;
    assert!(r.partial.is_none());
    // With no full block held, partial blocks hang under the namespace's root.
    let r = ask(&mut c, vec![], vec![1, 2, 3]).await;
    assert_eq!(r.partial.as_ref().unwrap().key, key(&root_partial));
    svc.stop();

    // After a restart the partial blocks come from the disk index, and fetch intact.
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    let r = ask(&mut c, keys, prompt(&tail5)).await;
    assert_eq!(r.partial_tokens, 5);
    assert_eq!(Tier::try_from(r.partial.unwrap().tier).unwrap(), Tier::Disk);
    let got = fetch(&mut c, std::slice::from_ref(&partial5)).await;
    assert_eq!(got[0].as_ref().unwrap(), &partial5);
    svc.stop();
}

/// Blocks of namespace `ns`: `n` chained blocks, token ids and payload bytes varied by `seed`.
fn chain_in(ns: &str, n: usize, seed: u32) -> Vec<Block> {
    let mut parent: Option<BlockKey> = None;
    (0..n)
        .map(|i| {
            let tokens: Vec<u32> = (0..TOKENS_PER_BLOCK)
                .map(|t| seed + i as u32 * 1000 + t)
                .collect();
            let bytes = 2 * LAYOUT.0 * LAYOUT.1 * LAYOUT.2 * 4 * TOKENS_PER_BLOCK;
            let payload: Vec<u8> = (0..bytes).map(|b| (b ^ seed) as u8).collect();
            let block = make_block(ns, parent.as_ref(), tokens, LAYOUT, payload);
            parent = BlockKey::from_slice(&block.header.as_ref().unwrap().key);
            block
        })
        .collect()
}

async fn wait_for_writer(
    c: &mut KvCacheClient<Channel>,
    settled: impl Fn(&StatsResponse) -> bool,
) -> StatsResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
        if settled(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "writer did not settle: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn namespace_quotas_evict_within_their_namespace_and_stats_are_per_namespace() {
    let dir = tempfile::tempdir().unwrap();
    // Test blocks are about 32 KiB on disk: "small" may hold three, "big" has no quota.
    let svc = Service::start_with(dir.path(), &["--quota", "small=100KiB"]);
    let mut c = svc.client();
    let big = chain_in("big", 6, 1);
    let small = chain_in("small", 6, 2);
    assert_eq!(store(&mut c, big.clone()).await, 6);
    assert_eq!(store(&mut c, small.clone()).await, 6);
    let stats = wait_for_writer(&mut c, |s| {
        s.namespaces
            .iter()
            .find(|n| n.namespace == "small")
            .is_some_and(|n| n.disk.as_ref().unwrap().evictions == 3)
            && s.disk.as_ref().unwrap().blocks == 9
    })
    .await;
    let ns = |name: &str| {
        stats
            .namespaces
            .iter()
            .find(|n| n.namespace == name)
            .cloned()
            .unwrap()
    };
    let (small_ns, big_ns) = (ns("small"), ns("big"));
    assert_eq!(small_ns.disk_quota_bytes, 100 * 1024);
    assert!(
        small_ns.disk.as_ref().unwrap().bytes <= 100 * 1024,
        "{small_ns:?}"
    );
    assert_eq!(small_ns.disk.as_ref().unwrap().blocks, 3);
    // The other namespace lost nothing to the small one's quota.
    assert_eq!(big_ns.disk.as_ref().unwrap().blocks, 6);
    assert_eq!(big_ns.disk.as_ref().unwrap().evictions, 0);
    assert_eq!(big_ns.disk_quota_bytes, 0);
    // Hits and misses are counted per namespace too.
    let got = fetch_in(&mut c, "big", &big[..2]).await;
    assert!(got.iter().all(|b| b.is_ok()));
    let req = FetchRequest {
        namespace: "small".into(),
        keys: vec![key(&big[0])],
        file_reads: false,
        snapshot_of_last_only: false,
    };
    let mut s = c.fetch(req).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap_err().code(), tonic::Code::NotFound);
    let stats = c.stats(StatsRequest {}).await.unwrap().into_inner();
    let hits = |name: &str| {
        let n = stats
            .namespaces
            .iter()
            .find(|n| n.namespace == name)
            .unwrap();
        (
            n.ram.as_ref().unwrap().hits + n.disk.as_ref().unwrap().hits,
            n.misses,
        )
    };
    assert_eq!(hits("big"), (2, 0));
    assert_eq!(hits("small"), (0, 1));
    svc.stop();
}

/// Flips a bit in the last byte of block `key`'s file in the store under `dir`; returns its
/// path.
fn damage_last_byte(dir: &Path, key: &BlockKey) -> PathBuf {
    let hex = key.hex();
    let path = dir
        .join("store/blocks")
        .join(&hex[..2])
        .join(format!("{hex}.blk"));
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    path
}

#[tokio::test]
async fn the_worker_client_reads_disk_blocks_from_their_files_and_verifies_them() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = chain(6);
    {
        let svc = Service::start(dir.path());
        let mut c = svc.client();
        assert_eq!(store(&mut c, blocks.clone()).await, 6);
        svc.stop();
    }
    let svc = Service::start(dir.path());
    let keys: Vec<BlockKey> = blocks
        .iter()
        .map(|b| BlockKey::from_slice(&key(b)).unwrap())
        .collect();
    let mut client = CacheClient::connect(&svc.socket, Duration::from_secs(2));
    let got = client
        .fetch_prefix(NS, &keys, Duration::from_secs(10), Snapshots::Every)
        .await
        .unwrap();
    assert_eq!(got.len(), 6);
    for (g, b) in got.iter().zip(&blocks) {
        assert_eq!(g.header, b.header);
        assert_eq!(g.payload, b.payload);
        assert!(g.file.is_none());
    }
    let stats = svc
        .client()
        .stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.disk.unwrap().hits, 6, "file reads count as disk hits");
    assert_eq!(
        stats.ram.unwrap().blocks,
        0,
        "and are not promoted to the service's RAM"
    );

    // A block file altered on disk ends the prefix there: nothing wrong is ever returned.
    let path = damage_last_byte(dir.path(), &keys[3]);
    let got = client
        .fetch_prefix(NS, &keys, Duration::from_secs(10), Snapshots::Every)
        .await
        .unwrap();
    assert_eq!(got.len(), 3);
    // The client reported the bad file: the service checked it, dropped it and counted it,
    // so the next fetch is a plain miss there, not another bad read.
    let stats = svc
        .client()
        .stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.corrupt_blocks, 1);
    assert!(!path.exists(), "the corrupt file is deleted");
    assert_eq!(lookup(&mut svc.client(), &blocks).await.len(), 3);
    // A report about a good block drops nothing: the client's word alone is not enough.
    let r = svc
        .client()
        .report(ReportRequest {
            namespace: NS.into(),
            key: keys[0].0.to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!r.dropped);
    assert_eq!(lookup(&mut svc.client(), &blocks).await.len(), 3);
    // Another namespace's client gets nothing, though it could read the files.
    let got = client
        .fetch_prefix(
            "someone-else",
            &keys,
            Duration::from_secs(10),
            Snapshots::Every,
        )
        .await
        .unwrap();
    assert!(got.is_empty());
    svc.stop();
}

/// The blocks of `keys` the client fetches (`fetch_prefix`), with `snapshots`.
async fn fetch_with(
    client: &mut CacheClient,
    keys: &[BlockKey],
    snapshots: Snapshots,
) -> Vec<Block> {
    client
        .fetch_prefix(NS, keys, Duration::from_secs(10), snapshots)
        .await
        .unwrap()
}

/// `chain(n)` as a hybrid model's: each block's K/V, then 3 recurrent layers' snapshots of 64
/// floats.
fn hybrid_chain(n: usize) -> Vec<Block> {
    chain(n)
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let h = b.header.unwrap();
            let parent = BlockKey::from_slice(&h.parent);
            let mut payload = b.payload.to_vec();
            payload.extend((0..3 * 64 * 4).map(|x| (x * 5 + i) as u8));
            let block = make_block_of(
                NS,
                parent.as_ref(),
                h.token_ids,
                TOKENS_PER_BLOCK,
                LAYOUT,
                payload,
            );
            with_recurrent_state(block, 3, 64)
        })
        .collect()
}

#[tokio::test]
async fn a_hybrid_hit_reads_only_its_last_blocks_snapshot_from_files_and_from_ram() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = hybrid_chain(5);
    let keys: Vec<BlockKey> = blocks
        .iter()
        .map(|b| BlockKey::from_slice(&key(b)).unwrap())
        .collect();
    let kv = |b: &Block| b.payload.len() - 3 * 64 * 4;
    let check = |got: &[Block], n: usize| {
        assert_eq!(got.len(), n);
        for (i, (g, b)) in got.iter().zip(&blocks).enumerate() {
            assert_eq!(g.header, b.header);
            if i + 1 == n {
                assert_eq!(
                    g.payload, b.payload,
                    "the last block whole, snapshot included"
                );
            } else {
                assert_eq!(
                    g.payload,
                    b.payload.slice(..kv(b)),
                    "block {i}: its K/V only"
                );
            }
        }
    };
    {
        let svc = Service::start(dir.path());
        assert_eq!(store(&mut svc.client(), blocks.clone()).await, 5);
        svc.stop();
    }
    // From the disk tier: the client reads the K/V part of each file, the last one whole.
    let svc = Service::start(dir.path());
    let mut client = CacheClient::connect(&svc.socket, Duration::from_secs(2));
    let got = fetch_with(&mut client, &keys, Snapshots::LastOnly).await;
    check(&got, 5);
    let every = fetch_with(&mut client, &keys, Snapshots::Every).await;
    assert!(
        every
            .iter()
            .zip(&blocks)
            .all(|(g, b)| g.payload == b.payload)
    );
    // The last block's file damaged in its snapshot: the prefix ends before it, and the block
    // that ends it now is read again, whole, so that its snapshot is there to resume from.
    damage_last_byte(dir.path(), &keys[4]);
    let got = fetch_with(&mut client, &keys, Snapshots::LastOnly).await;
    check(&got, 4);
    svc.stop();

    // From the service's RAM (no disk writes left today): the service sends the K/V parts.
    let dir = tempfile::tempdir().unwrap();
    let svc = Service::start_with(dir.path(), &["--disk-write-budget", "1KiB"]);
    assert_eq!(store(&mut svc.client(), blocks.clone()).await, 5);
    let mut client = CacheClient::connect(&svc.socket, Duration::from_secs(2));
    let got = fetch_with(&mut client, &keys, Snapshots::LastOnly).await;
    check(&got, 5);
    let got = fetch_with(&mut client, &keys[..2], Snapshots::LastOnly).await;
    check(&got, 2);
    svc.stop();
}

/// A tmpfs of `mib` MiB mounted at `dir`, unmounted on drop. None where mounting is not
/// allowed (not root, or no CAP_SYS_ADMIN in a container).
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, mib: u32) -> Option<Self> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(dir.to_owned()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_degrades_to_ram_only_and_recovers_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_disk) = SmallDisk::mount(&dir.path().join("store"), 4) else {
        // Loud, not silent: this test needs a small file system of its own to fill.
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)");
        return;
    };
    // --disk (64 MiB) is far above the 4 MiB the file system really has.
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    // Fill the file system behind the service's back, leaving about 100 KiB.
    let filler = dir.path().join("store/filler");
    let free = free_bytes(&dir.path().join("store"));
    std::fs::write(&filler, vec![0u8; (free - 100 * 1024) as usize]).unwrap();

    let blocks = chain(8);
    assert_eq!(
        store(&mut c, blocks.clone()).await,
        8,
        "accepted into RAM regardless"
    );
    let stats = wait_for_writer(&mut c, |s| {
        !s.disk_degraded.is_empty() && s.disk.as_ref().unwrap().blocks + s.disk_write_failures >= 8
    })
    .await;
    assert!(
        stats.disk_degraded.contains("No space left"),
        "{:?}",
        stats.disk_degraded
    );
    // Every block is still served, from RAM, intact.
    let got = fetch(&mut c, &blocks).await;
    assert_eq!(got.len(), 8);
    for (g, b) in got.iter().zip(&blocks) {
        assert_eq!(g.as_ref().unwrap().payload, b.payload);
    }
    // No half-written file is left behind.
    let tmp_files = walk(&dir.path().join("store/blocks"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "tmp"))
        .count();
    assert_eq!(tmp_files, 0);

    // Space returns: the next blocks are written again and the state clears.
    std::fs::remove_file(&filler).unwrap();
    let more = chain_in(NS, 2, 77);
    assert_eq!(store(&mut c, more.clone()).await, 2);
    let stats = wait_for_writer(&mut c, |s| s.disk_degraded.is_empty()).await;
    assert!(stats.disk.unwrap().blocks >= 2);
    svc.stop();
}

/// `dir` bind-mounted onto itself, so that it can be flipped read-only while the service
/// keeps other files (its index) open for writing elsewhere; unmounted on drop.
struct BindMount(PathBuf);

impl BindMount {
    fn new(dir: &Path) -> Self {
        mount(&["--bind"], dir, dir);
        Self(dir.to_owned())
    }

    fn set(&self, mode: &str) {
        mount(&["-o", &format!("remount,bind,{mode}")], &self.0, &self.0);
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn mount(args: &[&str], source: &Path, target: &Path) {
    let status = Command::new("mount")
        .args(args)
        .arg(source)
        .arg(target)
        .status();
    assert!(
        status.is_ok_and(|s| s.success()),
        "mount {args:?} {}",
        target.display()
    );
}

#[tokio::test]
async fn a_read_only_cache_directory_degrades_to_ram_only_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let Some(_disk) = SmallDisk::mount(&store_dir, 16) else {
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)");
        return;
    };
    let svc = Service::start(dir.path());
    let mut c = svc.client();
    // Blocks written while the disk takes writes.
    let before = chain_in(NS, 3, 11);
    assert_eq!(store(&mut c, before.clone()).await, 3);
    wait_for_writer(&mut c, |s| s.disk.as_ref().unwrap().blocks >= 3).await;

    // The block directory turns read-only under the running service (as a failing disk
    // does; root ignores file modes, so a mount flag is what makes it real here).
    let blocks_dir = BindMount::new(&store_dir.join("blocks"));
    blocks_dir.set("ro");
    let during = chain_in(NS, 4, 22);
    assert_eq!(store(&mut c, during.clone()).await, 4, "accepted into RAM");
    let stats = wait_for_writer(&mut c, |s| !s.disk_degraded.is_empty()).await;
    assert!(
        stats.disk_degraded.contains("Read-only file system"),
        "{:?}",
        stats.disk_degraded
    );
    // Everything is still served intact: the new blocks from RAM, the old ones too.
    for blocks in [&before, &during] {
        let got = fetch(&mut c, blocks).await;
        assert_eq!(got.len(), blocks.len());
        for (g, b) in got.iter().zip(blocks.iter()) {
            assert_eq!(g.as_ref().unwrap().payload, b.payload);
        }
    }

    // Writable again: new blocks reach the disk and the state clears.
    blocks_dir.set("rw");
    let after = chain_in(NS, 2, 33);
    assert_eq!(store(&mut c, after).await, 2);
    // (Waiting for both: a write that got through while the mount flag was changing may
    // have cleared the state early.)
    let stats = wait_for_writer(&mut c, |s| {
        s.disk_degraded.is_empty() && s.disk.as_ref().is_some_and(|d| d.blocks >= 5)
    })
    .await;
    assert!(stats.disk.unwrap().blocks >= 5);
    svc.stop();
}

fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs(3) fills the struct we own.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    s.f_bavail as u64 * s.f_frsize as u64
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test]
async fn peak_rss_stays_under_ram_plus_64_mib_under_concurrent_load() {
    const RAM: u64 = 32 << 20;
    let dir = tempfile::tempdir().unwrap();
    let mut svc = Service::start_with(dir.path(), &["--ram", "32MiB", "--disk", "512MiB"]);
    // 8 clients, each storing and reading back 48 blocks of 1 MiB: 384 MiB through a
    // service allowed 32 MiB of RAM tier.
    let layout = (8, 8, 64, "float32"); // 2*8*8*64*4 = 32 KiB per token, 32 tokens a block
    let mut tasks = Vec::new();
    for client_no in 0..8u32 {
        let mut c = svc.client();
        tasks.push(tokio::spawn(async move {
            let ns = format!("load-{client_no}");
            let mut parent: Option<BlockKey> = None;
            let blocks: Vec<Block> = (0..48u32)
                .map(|i| {
                    let tokens: Vec<u32> = (0..32).map(|t| i * 100 + t).collect();
                    let payload = vec![(i + client_no) as u8; 1 << 20];
                    let b = make_block(&ns, parent.as_ref(), tokens, layout, payload);
                    parent = BlockKey::from_slice(&key(&b));
                    b
                })
                .collect();
            for chunk in blocks.chunks(8) {
                store(&mut c, chunk.to_vec()).await;
            }
            let mut served = 0;
            for chunk in blocks.chunks(8) {
                for b in fetch_in(&mut c, &ns, chunk).await.into_iter().flatten() {
                    served += b.payload.len();
                }
            }
            served
        }));
    }
    let mut served = 0;
    for t in tasks {
        served += t.await.unwrap();
    }
    assert!(served > 0, "nothing was served back");
    let peak = peak_rss_bytes(svc.child.id());
    eprintln!("peak RSS {} MiB with --ram 32MiB", peak >> 20);
    assert!(
        peak < RAM + (64 << 20),
        "peak RSS {} MiB exceeds --ram + 64 MiB",
        peak >> 20
    );
    assert!(svc.child.try_wait().unwrap().is_none());
    svc.stop();
}

#[tokio::test]
async fn blocks_the_writer_could_not_take_at_once_reach_the_disk_when_it_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Service::start_with(dir.path(), &["--ram", "256MiB", "--disk", "512MiB"]);
    let mut c = svc.client();
    // 96 blocks of 1 MiB in one stream: far more than the writer's 16 MiB queue holds.
    let layout = (8, 8, 64, "float32");
    let mut parent: Option<BlockKey> = None;
    let blocks: Vec<Block> = (0..96u32)
        .map(|i| {
            let tokens: Vec<u32> = (0..32).map(|t| i * 100 + t).collect();
            let b = make_block(NS, parent.as_ref(), tokens, layout, vec![i as u8; 1 << 20]);
            parent = BlockKey::from_slice(&key(&b));
            b
        })
        .collect();
    assert_eq!(store(&mut c, blocks.clone()).await, 96);
    let stats = wait_for_writer(&mut c, |s| s.disk.as_ref().unwrap().blocks == 96).await;
    eprintln!(
        "deferred by a full queue: {}, evicted unwritten: {}",
        stats.writes_deferred, stats.evicted_unwritten
    );
    assert_eq!(stats.evicted_unwritten, 0);
    svc.stop();
    // All of them come back from disk alone.
    let svc = Service::start_with(dir.path(), &["--ram", "256MiB", "--disk", "512MiB"]);
    let mut c = svc.client();
    assert_eq!(lookup(&mut c, &blocks).await, vec![Tier::Disk; 96]);
    svc.stop();
}
