//! The real `strata-kvcache` binary over a real Unix socket: store, look up and fetch blocks;
//! stop and restart (blocks come back from disk); a corrupted file is a counted miss; and
//! 20 rounds of kill -9 during heavy writes, after which every block served is byte-for-byte
//! what was written.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use strata_kvcache::block::{BlockKey, make_block, make_block_of};
use strata_proto::kvcache::kv_cache_client::KvCacheClient;
use strata_proto::kvcache::{Block, FetchRequest, LookupRequest, StatsRequest, Tier};
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

impl Service {
    fn start(dir: &Path) -> Self {
        Self::start_with(dir, &[])
    }

    fn start_with(dir: &Path, extra: &[&str]) -> Self {
        let socket = dir.join("kv.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata-kvcache"))
            .args(["serve", "--ram", "8MiB", "--disk", "64MiB"])
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
    let req = FetchRequest {
        namespace: NS.into(),
        keys: blocks.iter().map(key).collect(),
        file_reads: false,
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
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    // Another model's namespace never sees these blocks.
    let req = FetchRequest {
        namespace: "another-model".into(),
        keys: vec![key(&blocks[0])],
        file_reads: false,
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
        let mut c = c.clone();
        async move {
            c.lookup(LookupRequest {
                namespace: NS.into(),
                keys,
                prompt_tokens: tokens,
                block_tokens: TOKENS_PER_BLOCK,
            })
            .await
            .unwrap()
            .into_inner()
        }
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
