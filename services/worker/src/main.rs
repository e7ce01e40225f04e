//! `strata-worker`: serves one model over gRPC on a Unix socket. Normally started by `strata up`.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use anyhow::Context;
use clap::{Parser, Subcommand};
use strata_proto::worker::InfoResponse;
use strata_proto::worker::worker_server::WorkerServer;
use strata_worker::embedder::Embedder;
use strata_worker::engine::generate::{EngineOptions, GenerateRequest};
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::sample::SamplingParams;
use strata_worker::engine::speculative::Draft;
use strata_worker::engine::{DtypePolicy, policy};
use strata_worker::grpc::{EmbeddingServing, ModelInfo, Served, Serving, WorkerService};
use strata_worker::kv_quant::KvQuant;
use strata_worker::prefix_cache::{Parking, PrefixCache, Reuse};
use strata_worker::scheduler::Scheduler;
use strata_worker::template::ChatMessage;
use strata_worker::{blas_env, mlx_device};

#[derive(Parser)]
#[command(
    name = "strata-worker",
    version,
    about = "Strata worker: one model, MLX inference, gRPC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Worker gRPC service on a Unix socket until SIGTERM or Ctrl-C.
    Serve {
        /// Unix socket to listen on (created with mode 0600). It appears once the model is
        /// loaded.
        #[arg(long)]
        socket: PathBuf,
        /// GGUF file or safetensors folder of the model to serve; without it the worker
        /// answers only Health (for tests of supervision).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The id clients use for this model [default: the file or folder name].
        #[arg(long)]
        model_id: Option<String>,
        #[arg(long)]
        dtype_policy: Option<DtypePolicy>,
        #[arg(long, default_value_t = 256)]
        block_tokens: usize,
        /// Tokens per prefill pass, rounded down to whole blocks [default: 256 on the CPU,
        /// 4096 on a GPU]. With --cache-exact a pass is one block, so that a hit repeats a
        /// cold run's passes.
        #[arg(long)]
        prefill_chunk_tokens: Option<usize>,
        /// Requests that may wait for the engine; more are refused (the gateway answers 429).
        #[arg(long, default_value_t = 64)]
        queue: usize,
        /// Sequences decoded together in one forward pass.
        #[arg(long, default_value_t = 8)]
        max_batch: usize,
        /// The cache service's socket: prompts' KV blocks are looked up there and stored there.
        /// Without it, nothing is cached.
        #[arg(long)]
        kvcache_socket: Option<PathBuf>,
        /// L0: bytes of recent KV blocks this worker keeps itself (0 turns it off).
        #[arg(long, default_value = "256MiB", value_parser = parse_bytes)]
        l0_bytes: u64,
        /// Bytes of finished sequences' live KV caches kept for the next prompt that shares
        /// their start (0 turns parking off; default 8 GiB on a GPU, 1 GiB on a CPU).
        #[arg(long, value_parser = parse_bytes)]
        parked_bytes: Option<u64>,
        /// Memory this worker may use in all (model, L0, KV caches, activations); requests
        /// that would not fit are refused [default: 80% of physical memory].
        #[arg(long, value_parser = parse_bytes)]
        memory_budget: Option<u64>,
        /// Also cache blocks of generated tokens, so that the next turn of a chat can skip
        /// them. Off by default: KV computed while decoding rounds differently from KV computed
        /// by a prefill, so a later hit on such a block is close to, but not bit-identical
        /// with, computing it.
        #[arg(long)]
        store_decode_kv: bool,
        /// Block-granular cache hits, bit-identical with a cold run that has the same chunk
        /// ends. By default a hit reuses the longest common prefix at any token, also the
        /// leading rows of a block whose later tokens differ; the rest is computed in a chunk
        /// of another shape, so the result equals a cold run within floating-point rounding.
        #[arg(long)]
        cache_exact: bool,
        /// Bits per value of cached KV blocks [default: the live KV dtype's, 32 on CPU, 16 on
        /// GPUs: hits are then bit-identical with computing the prompt]. 16 for KV computed in
        /// float32 stores float16 (half the bytes); 8 or 4 store affine codes (3.6x or 6.4x
        /// fewer bytes than float32, in RAM, on the wire and on SSD). Such hits are close to,
        /// not identical with, computing the prompt; their blocks live under their own
        /// namespace.
        #[arg(long)]
        kv_cache_bits: Option<u32>,
        /// Tokens of context to serve instead of the model's own (prompt plus answer): less
        /// bounds memory, more runs past what the model was trained on (RoPE extrapolates,
        /// the answers may degrade; the log says so).
        #[arg(long)]
        context_length: Option<usize>,
        /// Tokens of a synthetic prompt run once at load (a prefill and a decode step,
        /// discarded), so that MLX compiles its GPU kernels before the first request instead
        /// of during it [default: 4096 on a GPU, 0 on the CPU, where nothing is compiled].
        #[arg(long)]
        warmup_tokens: Option<usize>,
        #[command(flatten)]
        draft: DraftArgs,
        #[command(flatten)]
        products: ProductArgs,
    },
    /// Print which MLX library and device this process gets, then exit.
    Probe,
    /// Generate a completion for a prompt and print it (streamed as it is produced).
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt text.
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt as one user message in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// System message (with --chat).
        #[arg(long, requires = "chat")]
        system: Option<String>,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// 0 is greedy decoding.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[arg(long)]
        seed: Option<u64>,
        /// Stop before this string (repeatable).
        #[arg(long)]
        stop: Vec<String>,
        /// Print the generated token ids and timings after the text.
        #[arg(long)]
        verbose: bool,
        /// SpecPrefill: prefill only this fraction of the prompt, chosen by the draft model
        /// (needs --draft-model).
        #[arg(long)]
        prune_keep_ratio: Option<f32>,
    },
    /// Measure prefill and decode speed on given prompts (ids from a JSON file: a list of
    /// lists of token ids); prints one JSON line per prompt. Driven by scripts/bench_engine.py.
    Bench {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt_ids: PathBuf,
        #[arg(long, default_value_t = 64)]
        decode_tokens: usize,
        /// Runs per prompt; the median is reported.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
    },
    /// Print the token ids of a text, as the model's tokenizer splits it.
    Tokenize {
        #[command(flatten)]
        model: ModelArgs,
        text: String,
    },
}

#[derive(clap::Args)]
struct ModelArgs {
    /// GGUF file or Hugging Face / MLX safetensors folder.
    #[arg(long)]
    model: PathBuf,
    /// f32 (CPU default), quantized-f16 or quantized-bf16 (GPU default).
    #[arg(long)]
    dtype_policy: Option<DtypePolicy>,
    /// Tokens per KV block (and prefill chunks are whole blocks).
    #[arg(long, default_value_t = 256)]
    block_tokens: usize,
    /// Tokens per prefill pass, rounded down to whole blocks [default: 256 on the CPU, 4096 on
    /// a GPU].
    #[arg(long)]
    prefill_chunk_tokens: Option<usize>,
    #[command(flatten)]
    draft: DraftArgs,
    #[command(flatten)]
    products: ProductArgs,
}

#[derive(clap::Args, Clone, Copy)]
struct ProductArgs {
    /// How a CPU multiplies a chunk of 8 or more prompt rows by weights kept as codes (GGUF
    /// files): f32, or bf16 (`vdpbf16ps`, twice the multiply-adds per instruction, on CPUs with
    /// AVX-512 BF16; `x` and the dequantised weights are rounded to bf16, sums stay f32, so
    /// answers differ from f32 within that rounding). Decode steps and short chunks stay f32.
    #[arg(long, value_enum, default_value_t = CpuProducts::F32)]
    cpu_products: CpuProducts,
}

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
enum CpuProducts {
    F32,
    Bf16,
}

impl ProductArgs {
    /// Applies the choice to the process's kernels (before the model loads: the blocks'
    /// fingerprint names it); returns whether bf16 was asked for.
    fn apply(&self) -> bool {
        let asked = self.cpu_products == CpuProducts::Bf16;
        if strata_cpu_kernels::packed::set_bf16_products(asked) != asked {
            tracing::warn!(
                feature = "cpu_products",
                "not applied: --cpu-products bf16 needs a CPU with AVX-512 BF16; products stay f32"
            );
        }
        asked
    }
}

/// The `cpu_products` feature line.
fn cpu_products_feature(loaded: &LoadedModel) -> String {
    let asked_bf16 = loaded.bf16_products_asked;
    if loaded.bf16_products {
        "bf16 for products of 8+ rows by weights kept as codes (AVX-512 BF16); decode steps \
         and shorter chunks f32"
            .into()
    } else if asked_bf16 && strata_cpu_kernels::packed::bf16_products() {
        "f32 (NOT APPLIED: bf16 was asked for, and this model keeps no weights as codes)".into()
    } else if asked_bf16 {
        "f32 (NOT APPLIED: bf16 was asked for, and this CPU has no AVX-512 BF16)".into()
    } else {
        "f32".into()
    }
}

#[derive(clap::Args, Clone)]
struct DraftArgs {
    /// A draft model (GGUF file or safetensors folder) with the same tokenizer: requests then
    /// decode speculatively unless they opt out. One with another tokenizer is refused.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Tokens the draft proposes per step.
    #[arg(long, default_value_t = strata_worker::engine::speculative::DEFAULT_DRAFT_TOKENS)]
    draft_tokens: usize,
}

impl ModelArgs {
    fn open(&self, device: &str) -> anyhow::Result<LoadedModel> {
        let policy = self
            .dtype_policy
            .unwrap_or_else(|| DtypePolicy::for_device(device));
        let asked_bf16 = self.products.apply();
        let started = std::time::Instant::now();
        let mut model = loader::open(&self.model, policy, self.block_tokens)
            .with_context(|| format!("loading {}", self.model.display()))?;
        model.bf16_products_asked = asked_bf16;
        if asked_bf16 && !model.bf16_products && strata_cpu_kernels::packed::bf16_products() {
            tracing::warn!(
                feature = "cpu_products",
                "not applied: --cpu-products bf16 concerns weights kept as codes, and this model                  keeps none; products stay f32"
            );
        }
        let code_bytes = model.model.weight_code_bytes();
        tracing::info!(
            model = %self.model.display(),
            policy = %policy,
            cpu_products = %cpu_products_feature(&model),
            seconds = started.elapsed().as_secs_f32(),
            weight_codes_mb = code_bytes / (1 << 20),
            "model loaded"
        );
        if code_bytes > 0 && !strata_worker::engine::weights::codes_replace_expansion() {
            tracing::warn!(
                "no BLAS sgemm found in the process: matrices with codes also keep their f32 \
                 expansion for long products (about 4 bytes per weight more)"
            );
        }
        if let Some(path) = &self.draft.draft_model {
            let draft = Draft::open(path, policy, self.draft.draft_tokens, &model)
                .with_context(|| format!("loading the draft model {}", path.display()))?;
            tracing::info!(draft = %path.display(), tokens = draft.tokens, "draft model loaded: speculative decoding on");
            model.draft = Some(draft);
        }
        Ok(model)
    }

    /// The engine's options on `device` ("cpu" or "gpu"): the prefill pass the operator named,
    /// or the device's default.
    fn options(&self, device: &str) -> EngineOptions {
        EngineOptions {
            prefill_chunk_tokens: self
                .prefill_chunk_tokens
                .unwrap_or_else(|| policy::default_prefill_chunk_tokens(device)),
            ..EngineOptions::default()
        }
    }
}

fn main() -> anyhow::Result<()> {
    // Sockets, tokens, block files: nothing this process writes is readable by other users.
    strata_runtime::private::restrict_new_files();
    // Must run before anything else: OpenBLAS reads its settings when libmlx loads.
    let reexec = blas_env::reexec_with_blas_env();
    mlx_device::keep_freed_memory_mapped();
    let cli = Cli::parse();
    // `serve` exports traces when the gateway says where (inside its runtime, below).
    let reexec_warning = |e: &dyn std::fmt::Display| {
        tracing::warn!(error = %e, "could not re-execute with OpenBLAS settings; using its defaults");
    };
    let coretype = std::env::var("OPENBLAS_CORETYPE").ok();
    let coretype_notice = || {
        if let Some(notice) = blas_env::coretype_notice(coretype.as_deref(), &blas_env::cpu_flags())
        {
            tracing::warn!("{notice}");
        }
    };
    if !matches!(cli.command, Command::Serve { .. }) {
        strata_runtime::logging::init("strata-worker");
        if let Err(e) = &reexec {
            reexec_warning(e);
        }
        coretype_notice();
    }
    let device = mlx_device::select_default_device();
    let info = ModelInfo {
        model_path: None,
        mlx_version: mlx_device::mlx_version(),
        device: device.to_string(),
    };
    match cli.command {
        Command::Probe => {
            println!("mlx {} on {}", info.mlx_version, info.device);
            Ok(())
        }
        Command::Bench {
            model,
            prompt_ids,
            decode_tokens,
            repeat,
        } => {
            let loaded = model.open(&info.device)?;
            let text = std::fs::read_to_string(&prompt_ids)
                .with_context(|| format!("read {}", prompt_ids.display()))?;
            let prompts: Vec<Vec<u32>> = serde_json::from_str(&text).with_context(|| {
                format!("{}: expected a list of lists of ids", prompt_ids.display())
            })?;
            let options = model.options(&info.device);
            // Warm-up: first calls pay for allocation and kernel set-up.
            let warm = GenerateRequest {
                ignore_eos: true,
                ..GenerateRequest::greedy(prompts.first().cloned().unwrap_or_default(), 4)
            };
            loaded.generate(&warm, &options, |_| true)?;
            for prompt in prompts {
                let mut prefill = Vec::new();
                let mut decode = Vec::new();
                for _ in 0..repeat.max(1) {
                    let req = GenerateRequest {
                        ignore_eos: true,
                        ..GenerateRequest::greedy(prompt.clone(), decode_tokens)
                    };
                    let g = loaded.generate(&req, &options, |_| true)?;
                    prefill.push(g.prompt_tokens as f64 / g.timings.prefill.as_secs_f64());
                    // The first token comes from the prefill's logits; the rest are decode steps.
                    let steps = g.tokens.len().saturating_sub(1).max(1);
                    decode.push(steps as f64 / g.timings.decode.as_secs_f64().max(1e-9));
                }
                println!(
                    "{}",
                    serde_json::json!({
                        "prompt_tokens": prompt.len(),
                        "prefill_tok_s": median(&mut prefill),
                        "decode_tok_s": median(&mut decode),
                        "prefill_runs": prefill,
                        "decode_runs": decode,
                    })
                );
            }
            Ok(())
        }
        Command::Tokenize { model, text } => {
            let loaded = model.open(&info.device)?;
            let ids = loaded.tokenizer.encode(&text)?;
            println!("{ids:?}");
            Ok(())
        }
        Command::Generate {
            model,
            prompt,
            chat,
            system,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop,
            verbose,
            prune_keep_ratio,
        } => {
            let loaded = model.open(&info.device)?;
            let text = if chat {
                let mut messages = Vec::new();
                if let Some(system) = system {
                    messages.push(ChatMessage::text("system", &system));
                }
                messages.push(ChatMessage::text("user", &prompt));
                loaded.template.render(&messages, true, None)?
            } else {
                prompt
            };
            let request = GenerateRequest {
                prompt: loaded.tokenizer.encode(&text)?,
                max_tokens,
                sampling: SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    seed,
                    ..SamplingParams::default()
                },
                stop,
                stop_token_ids: Vec::new(),
                ignore_eos: false,
                prefill_breaks: Vec::new(),
                message_ends: Vec::new(),
                images: Vec::new(),
                grammar: None,
                speculative: None,
                prune_keep_ratio,
            };
            use std::io::Write;
            let mut stdout = std::io::stdout();
            let generation = loaded.generate(&request, &model.options(&info.device), |event| {
                let _ = stdout.write_all(event.text.as_bytes());
                let _ = stdout.flush();
                true
            })?;
            println!();
            if verbose {
                let t = &generation.timings;
                println!("tokens: {:?}", generation.tokens);
                println!(
                    "finish: {:?}; prompt {} tokens, prefill {:.0} ms ({:.1} tok/s), {} generated in {:.0} ms ({:.1} tok/s)",
                    generation.finish,
                    generation.prompt_tokens,
                    t.prefill.as_secs_f64() * 1e3,
                    generation.prompt_tokens as f64 / t.prefill.as_secs_f64(),
                    generation.tokens.len(),
                    t.decode.as_secs_f64() * 1e3,
                    generation.tokens.len() as f64 / t.decode.as_secs_f64().max(1e-9),
                );
                if let Some(s) = &generation.speculation {
                    println!(
                        "speculation: {} steps, {} drafted, {} accepted ({:.0}%)",
                        s.steps,
                        s.drafted,
                        s.accepted,
                        100.0 * s.accepted as f64 / s.drafted.max(1) as f64
                    );
                }
                if generation.pruned_tokens > 0 {
                    println!(
                        "prompt pruning: {} of {} prompt tokens left out of the prefill",
                        generation.pruned_tokens, generation.prompt_tokens
                    );
                }
                for n in &generation.notices {
                    println!("notice: {}: {}", n.feature, n.message);
                }
            }
            Ok(())
        }
        Command::Serve {
            socket,
            model,
            model_id,
            dtype_policy,
            block_tokens,
            prefill_chunk_tokens,
            queue,
            max_batch,
            kvcache_socket,
            l0_bytes,
            parked_bytes,
            memory_budget,
            store_decode_kv,
            cache_exact,
            kv_cache_bits,
            context_length,
            warmup_tokens,
            draft,
            products,
        } => {
            let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
            let service_name = match (&model_id, &model) {
                (Some(id), _) => format!("strata-worker-{id}"),
                (None, Some(path)) => format!("strata-worker-{}", default_model_id(path)),
                (None, None) => "strata-worker".to_string(),
            };
            let _traces = {
                let _guard = runtime.enter();
                strata_runtime::logging::init_from_env("strata-worker", &service_name)
            };
            if let Err(e) = &reexec {
                reexec_warning(e);
            }
            coretype_notice();
            // A worker never outlives its gateway, on macOS too (no parent-death signal there).
            strata_runtime::parent::watch_parent(|| {
                strata_runtime::parent::terminate_self(std::time::Duration::from_secs(20))
            });
            // Set once the model is loaded (the scheme depends on the live KV dtype).
            let mut kv_quant = None;
            let embedding = match &model {
                Some(path) if is_embedding_model(path) => {
                    let id = model_id.clone().unwrap_or_else(|| default_model_id(path));
                    let budget = memory_budget
                        .unwrap_or(strata_worker::admission::physical_bytes() / 10 * 8);
                    Some(embedding_serving(id, path, queue, budget)?)
                }
                _ => None,
            };
            let serving = match &model {
                Some(_) if embedding.is_some() => None,
                Some(path) => {
                    let args = ModelArgs {
                        model: path.clone(),
                        dtype_policy,
                        block_tokens,
                        prefill_chunk_tokens,
                        draft,
                        products,
                    };
                    let mut loaded = args.open(&info.device)?;
                    if let Some(n) = context_length {
                        anyhow::ensure!(n >= 2, "--context-length must be at least 2");
                        let trained = loaded.model.config().context_length;
                        if n > trained {
                            tracing::warn!(
                                trained,
                                serving = n,
                                "serving a longer context than the model was trained on; answers past {trained} tokens may degrade"
                            );
                        }
                        loaded.model.set_context_length(n);
                    }
                    let layout = loaded.model.kv_layout();
                    kv_quant = kv_cache_bits
                        .map(|bits| KvQuant::from_bits(bits, layout.dtype))
                        .transpose()
                        .map_err(anyhow::Error::msg)
                        .context("--kv-cache-bits")?
                        .flatten();
                    if kv_quant.is_some() {
                        strata_worker::kv_quant::supports(layout.head_dim)
                            .context("--kv-cache-bits")?;
                        if layout.recurrent.is_some() {
                            anyhow::bail!(
                                "--kv-cache-bits: quantised blocks are not available for hybrid \
                                 models (their blocks carry recurrent states, kept in f32)"
                            );
                        }
                    }
                    let id = model_id.unwrap_or_else(|| default_model_id(path));
                    let budget = memory_budget
                        .unwrap_or(strata_worker::admission::physical_bytes() / 10 * 8);
                    let options = EngineOptions {
                        store_decode_kv,
                        last_token_alone: cache_exact,
                        // Exact hits repeat a cold run's passes only if a hit's first
                        // pass is shaped as the cold run's was: one block each.
                        prefill_chunk_tokens: if cache_exact {
                            block_tokens
                        } else {
                            args.options(&info.device).prefill_chunk_tokens
                        },
                        ..args.options(&info.device)
                    };
                    let warmup_tokens = warmup_tokens.unwrap_or(if info.device == "cpu" {
                        0
                    } else {
                        DEFAULT_GPU_WARMUP_TOKENS
                    });
                    let engine = EngineThread {
                        queue,
                        max_batch,
                        warmup_tokens,
                    };
                    Some(serving(id, loaded, options, engine, budget, l0_bytes))
                }
                None => None,
            };
            let info = ModelInfo {
                model_path: model,
                ..info
            };

            let serving = serving.map(|mut s| {
                let reuse = if s.kv_layout.recurrent.is_some() {
                    Reuse::AtSnapshots
                } else if cache_exact {
                    Reuse::Exact
                } else {
                    Reuse::CommonPrefix
                };
                let prefix_feature = match (&kvcache_socket, l0_bytes) {
                    (Some(_), 0) => format!("on (cache service only, L0 off; {})", reuse.describe()),
                    (Some(_), l0) => format!("on (L0 {} MiB + cache service; {})", l0 >> 20, reuse.describe()),
                    (None, 0) => "off (no cache service socket and L0 off)".to_string(),
                    (None, l0) => {
                        format!("on (L0 {} MiB only: no cache service socket; {})", l0 >> 20, reuse.describe())
                    }
                };
                s.features.push(("prefix_cache".into(), prefix_feature));
                // Parked caches are cut back to any prefix: not with cache.exact (block
                // ends only), a recurrent state or sliding windows.
                let parked_bytes = parked_bytes.unwrap_or(
                    strata_worker::engine::policy::default_parked_bytes(&info.device),
                );
                let parking = (reuse == Reuse::CommonPrefix
                    && s.kv_layout.window.is_none()
                    && parked_bytes > 0
                    && (kvcache_socket.is_some() || l0_bytes > 0))
                    .then(|| Parking::new(parked_bytes, Some(s.admission.clone())));
                s.features.push((
                    "parked_kv".into(),
                    match &parking {
                        Some(_) => format!(
                            "on (up to {} MiB of finished sequences' live KV caches, resumed in place by the next prompt that shares their start)",
                            parked_bytes >> 20
                        ),
                        None if reuse != Reuse::CommonPrefix => format!("off ({})", reuse.describe()),
                        None if s.kv_layout.window.is_some() => {
                            "off (sliding-window layers drop rows a shorter prefix would need)".into()
                        }
                        None => "off (parked_bytes is 0 or the prefix cache is off)".into(),
                    },
                ));
                s.features.push((
                    "kv_quantization".into(),
                    match kv_quant {
                        Some(q) => format!(
                            "on (cached blocks stored as {}: {:.1}x fewer bytes than {:?}; a hit is close to, not bit-identical with, computing the prompt)",
                            q.scheme(),
                            (s.kv_layout.head_dim * strata_worker::engine::policy::dtype_bytes(s.kv_layout.dtype)) as f64
                                / q.encoded_len(s.kv_layout.head_dim) as f64,
                            s.kv_layout.dtype
                        ),
                        None => format!(
                            "off (cached blocks hold {:?} KV, as computed: hits are bit-identical)",
                            s.kv_layout.dtype
                        ),
                    },
                ));
                if kvcache_socket.is_some() || l0_bytes > 0 {
                    let _guard = runtime.enter();
                    s.prefix_cache = Some(PrefixCache::new(
                        kvcache_socket.as_deref(),
                        l0_bytes,
                        &s.info.fingerprint,
                        s.info.block_tokens as usize,
                        s.kv_layout,
                        kv_quant,
                    ).with_reuse(reuse));
                    if let Some(p) = parking {
                        s.prefix_cache = s.prefix_cache.take().map(|pc| pc.with_parking(p));
                    }
                }
                s
            });
            let served = match (serving, embedding) {
                (Some(s), _) => Some(Served::Llm(Box::new(s))),
                (None, Some(e)) => Some(Served::Embedding(Box::new(e))),
                (None, None) => None,
            };
            let device = info.device.clone();
            let served = runtime.block_on(serve(socket, info, served));
            // Stores are drained and the engine stopped; the traces flush (on the runtime),
            // then the runtime's threads go, before the process ends.
            drop(_traces);
            drop(runtime);
            if device == "gpu" {
                exit_skipping_destructors(&served);
            }
            served
        }
    }
}

/// Ends the process without C++ static destructors. MLX's CUDA backend frees its buffers in
/// them, after the CUDA runtime has shut down, and aborts on the error ("cudaFree ... driver
/// shutting down"): a clean SIGTERM would otherwise exit with SIGABRT. Nothing is left to
/// write by now (stores drained, traces flushed); the driver reclaims the device memory.
fn exit_skipping_destructors(result: &anyhow::Result<()>) -> ! {
    use std::io::Write;
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("Error: {e:?}");
            1
        }
    };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; no Rust state is touched after it.
    unsafe { libc::_exit(code) }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| format!("{s:?}: {e} (e.g. 256MiB)"))
}

fn default_model_id(path: &std::path::Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// MLX's buffer cache on the CPU (see `serving`).
const CPU_MLX_CACHE_LIMIT: u64 = 128 << 20;

/// Puts a loaded model behind the engine thread.
/// Tokens of the load-time warm-up on a GPU: one 4096-token pass (the default pass there)
/// and a decode step compile the kernels a request uses. For Qwen3.6-35B-A3B's shape on an
/// H100 that was 137 s spent in the first requests (docs/BENCHMARKS.md).
const DEFAULT_GPU_WARMUP_TOKENS: usize = 4096;
/// The warm-up's entry in /admin's features (its time is added once it is done).
const WARMUP_FEATURE: &str = strata_worker::grpc::WARMUP_FEATURE;

/// How the engine thread runs: jobs that may wait, sequences per step, and the tokens of
/// the load-time warm-up (0: none).
struct EngineThread {
    queue: usize,
    max_batch: usize,
    warmup_tokens: usize,
}

/// Runs a synthetic prompt of `tokens` tokens and one decode step through the engine on its
/// thread, before the first job and outside the caches (nothing is stored or parked), so that
/// MLX compiles its GPU kernels then rather than in the first requests (requests sent
/// meanwhile wait in the queue, as they would for the compiling). The time goes to the
/// counters (/admin) and the log; a failure is reported there and the worker serves anyway.
fn warm_up(
    loaded: &LoadedModel,
    tokens: usize,
    options: &EngineOptions,
    counters: &strata_worker::scheduler::Counters,
) {
    if tokens == 0 {
        return;
    }
    let config = loaded.model.config();
    let tokens = tokens.min(config.context_length.saturating_sub(1)).max(1);
    let vocab = config.vocab_size.max(1);
    // Ids spread over the vocabulary (any ids do: only the shapes matter).
    let ids: Vec<u32> = (0..tokens).map(|i| (i * 7919 % vocab) as u32).collect();
    let started = std::time::Instant::now();
    let run = || -> strata_worker::engine::Result<()> {
        let mut cache = loaded.model.new_cache(options.kv_step_tokens);
        let logits = loaded.prefill(&mut cache, &ids, options, |_| Ok(()))?;
        let next = strata_worker::engine::sample::argmax(&logits) as u32;
        let step = loaded
            .model
            .forward(&mut [strata_worker::engine::llama::SeqChunk {
                tokens: &[next],
                cache: &mut cache,
            }])?;
        step.eval()?;
        Ok(())
    };
    let outcome = run();
    let seconds = started.elapsed().as_secs_f64();
    mlx_device::release_free_memory();
    match outcome {
        Ok(()) => tracing::info!(tokens, seconds, "kernels warmed up"),
        Err(e) => {
            counters.warmup_failed.store(true, Ordering::Relaxed);
            tracing::warn!(tokens, seconds, error = %e, "the load-time warm-up failed; serving anyway");
        }
    }
    counters
        .warmup_ms
        .store(((seconds * 1000.0) as u64).max(1), Ordering::Relaxed);
}

fn serving(
    id: String,
    loaded: LoadedModel,
    options: EngineOptions,
    engine: EngineThread,
    budget: u64,
    l0_bytes: u64,
) -> Serving {
    let EngineThread {
        queue,
        max_batch,
        warmup_tokens,
    } = engine;
    // MLX keeps freed buffers for reuse; bound that cache so it cannot eat the budget. On the
    // CPU its buffers are plain malloc blocks that glibc keeps mapped anyway
    // (`keep_freed_memory_mapped`), so a large cache only holds memory: SmolLM2 with a 4K
    // prompt and warm turns peaked at 2.56 GB with 1 GiB, 1.52 GB with 128 MiB and 1.41 GB
    // with none, at the same speed (cold 21-27 s, warm 0.23-0.36 s, noise of one run each).
    let cache_limit = if mlx_device::default_device_kind() == "cpu" {
        CPU_MLX_CACHE_LIMIT
    } else {
        (budget / 8).min(1 << 30)
    };
    if let Err(e) = mlx_rs::memory::set_cache_limit(cache_limit as usize) {
        tracing::warn!(error = %e, "could not bound MLX's buffer cache");
    }
    // The baseline: the model resident (without what loading freed), plus the L0 tier it
    // may fill.
    mlx_device::release_free_memory();
    let baseline = strata_worker::admission::resident_bytes() + l0_bytes;
    let mut admission = strata_worker::admission::Admission::new(
        budget,
        baseline,
        loaded.model.config(),
        loaded.model.kv_layout(),
        options.kv_step_tokens,
        options.prefill_chunk_tokens,
    );
    if let Some(d) = &loaded.draft {
        admission = admission.with_draft_kv(d.model.kv_layout().bytes_per_token() as u64);
    }
    admission = admission.with_snapshots_every(loaded.block_tokens);
    if admission.skipped {
        tracing::warn!(
            "memory admission is OFF ({}=1, debug build): requests that do not fit are run anyway",
            strata_worker::admission::SKIP_ENV
        );
    }
    tracing::info!(
        budget_mib = budget >> 20,
        baseline_mib = baseline >> 20,
        mlx_cache_limit_mib = cache_limit >> 20,
        "memory admission"
    );
    let config = loaded.model.config();
    let info = InfoResponse {
        model_id: id.clone(),
        kind: if loaded.vision.is_some() {
            "vlm"
        } else {
            "llm"
        }
        .into(),
        context_length: config.context_length as u32,
        kv_bytes_per_token: loaded.model.kv_layout().bytes_per_token() as u64,
        fingerprint: loaded.fingerprint.clone(),
        block_tokens: loaded.block_tokens as u32,
        model_path: loaded.path.display().to_string(),
        vocab_size: config.vocab_size as u32,
        chat_template: if loaded.template.is_fallback {
            "chatml-fallback".into()
        } else {
            "model".into()
        },
        dtype_policy: loaded.policy.to_string(),
        memory_budget_bytes: budget,
        memory_baseline_bytes: baseline,
        embedding_dimensions: 0,
        prefill_chunk_tokens: loaded.prefill_chunk(&options) as u32,
    };
    let context_length = config.context_length;
    let tokenizer = loaded.tokenizer.clone();
    let template = loaded.template.clone();
    let images = loaded.vision.as_ref().map(|v| v.input.clone());
    let mut features = vec![
        (
            "continuous_batching".into(),
            format!("on (up to {max_batch} sequences per step)"),
        ),
        (
            "memory_admission".into(),
            if admission.skipped {
                format!(
                    "OFF: every request admitted ({}=1 in a debug build, for fault tests)",
                    strata_worker::admission::SKIP_ENV
                )
            } else {
                format!("on (budget {} MiB)", budget >> 20)
            },
        ),
        (
            "prefill_chunks".into(),
            format!(
                "{} tokens per pass on the {} ({}); blocks for the cache are cut from the \
                 finished KV, one device synchronisation per pass",
                loaded.prefill_chunk(&options),
                mlx_device::default_device_kind(),
                if options.last_token_alone {
                    "one block: cache.exact"
                } else {
                    "--prefill-chunk-tokens, or the device's default"
                }
            ),
        ),
        (
            "kv_readback".into(),
            if strata_worker::device_copy::uses_driver() {
                "CUDA driver bulk copy of finished KV (MLX's managed memory read page by page \
                 is slower), one copy per block, made by the block finisher on its own stream \
                 while the engine goes on"
                    .into()
            } else {
                "direct read (the KV is in host memory, or no CUDA driver is loaded)".into()
            },
        ),
        (
            "store_decode_kv".into(),
            if options.store_decode_kv {
                "on (generated tokens' blocks are cached; not bit-identical to prefill)".into()
            } else {
                "off (generated tokens are cached by the next turn's prefill)".into()
            },
        ),
    ];
    features.push(("cpu_products".into(), cpu_products_feature(&loaded)));
    features.push((
        WARMUP_FEATURE.into(),
        if warmup_tokens == 0 {
            "off (--warmup-tokens 0; the CPU's default: MLX compiles no kernels there)".into()
        } else {
            format!(
                "on: a {warmup_tokens}-token pass and a decode step on the engine thread before \
                 the first request (MLX compiles GPU kernels at first use)"
            )
        },
    ));
    let warmup_options = options;
    features.push((
        strata_worker::engine::speculative::FEATURE.into(),
        match &loaded.draft {
            Some(d) => format!(
                "on (draft {}, {} tokens per step, exact rejection sampling; only for a request decoding alone: batched steps, structured output, logprobs, penalties and images decode without it, and the response says so)",
                d.path.display(),
                d.tokens
            ),
            None => "off (no draft model configured)".into(),
        },
    ));
    features.push((
        strata_worker::engine::spec_prefill::FEATURE.into(),
        match &loaded.draft {
            Some(_) => format!(
                "on request (\"prompt_pruning\": {{\"keep_ratio\": r}}; prompts of {}+ tokens: the draft scores them, the target prefills the kept chunks; answers may differ, the cache is not used for them)",
                strata_worker::engine::spec_prefill::MIN_PROMPT_TOKENS
            ),
            None => "off (no draft model to score prompts with; requests asking for it get a notice)".into(),
        },
    ));
    // Structured output: the token table for the grammar engine, built once.
    let grammar = match loaded.stop_tokens.first() {
        Some(&eos) => {
            strata_worker::grammar::GrammarEngine::new(tokenizer.library(), config.vocab_size, eos)
                .map(std::sync::Arc::new)
                .map_err(|e| e.to_string())
        }
        None => Err("the model has no end-of-sequence token to end a constrained answer".into()),
    };
    match &grammar {
        Ok(_) => features.push((
            "structured_output".into(),
            format!(
                "on ({}: JSON schemas and grammars enforced while sampling)",
                strata_worker::grammar::LLGUIDANCE_VERSION
            ),
        )),
        Err(why) => {
            tracing::warn!("structured output is OFF for this model: {why}");
            features.push(("structured_output".into(), format!("OFF: {why}")));
        }
    }
    features.push((
        "tool_calls".into(),
        if template.reads_tools {
            "on (the model's chat template renders the tools; calls are read from its <tool_call> blocks)".into()
        } else {
            "on (the chat template has no tools: their definitions and past calls are written into the prompt in the Hermes <tool_call> format)".into()
        },
    ));
    if let Some(i) = &images {
        features.push((
            "images".into(),
            format!(
                "on ({} prompt positions per image; cache keys carry the image's hash)",
                i.image_tokens
            ),
        ));
    }
    Serving {
        model_id: id,
        info,
        tokenizer,
        template,
        kv_layout: loaded.model.kv_layout(),
        admission,
        scheduler: Scheduler::start_after(loaded, options, queue, max_batch, move |m, c| {
            warm_up(m, warmup_tokens, &warmup_options, c)
        }),
        context_length,
        prefix_cache: None,
        images,
        features,
        grammar,
    }
}

/// A folder whose config.json describes a BERT-family encoder: served as an embedding model.
fn is_embedding_model(path: &std::path::Path) -> bool {
    std::fs::read(path.join("config.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .is_some_and(|config| strata_runtime::model_kind::is_bert_encoder(&config))
}

/// Loads an embedding model and starts its engine thread.
fn embedding_serving(
    id: String,
    path: &std::path::Path,
    queue: usize,
    budget: u64,
) -> anyhow::Result<EmbeddingServing> {
    let embedder = Embedder::start(path, queue)
        .with_context(|| format!("load the embedding model {}", path.display()))?;
    mlx_device::release_free_memory();
    let baseline = strata_worker::admission::resident_bytes();
    tracing::info!(
        model = %id,
        dimensions = embedder.dimensions,
        max_tokens = embedder.max_tokens,
        "embedding model loaded"
    );
    let info = InfoResponse {
        model_id: id.clone(),
        kind: "embedding".into(),
        context_length: embedder.max_tokens as u32,
        model_path: path.display().to_string(),
        dtype_policy: DtypePolicy::F32.to_string(),
        memory_budget_bytes: budget,
        memory_baseline_bytes: baseline,
        embedding_dimensions: embedder.dimensions as u32,
        prefill_chunk_tokens: 0,
        ..Default::default()
    };
    Ok(EmbeddingServing {
        model_id: id,
        info,
        features: vec![(
            "batching".into(),
            format!(
                "on (waiting inputs sorted by length, up to {} per forward pass)",
                strata_worker::embedder::MAX_BATCH
            ),
        )],
        embedder,
    })
}

/// How long a stopping worker waits for the cache service to take the blocks still queued
/// for it. With the gRPC drain (3 s) it stays inside the gateway's 10 s stop grace.
const STORE_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

async fn serve(socket: PathBuf, info: ModelInfo, serving: Option<Served>) -> anyhow::Result<()> {
    let incoming = strata_runtime::uds::bind(&socket).await?;
    let prefix_cache = match &serving {
        Some(Served::Llm(s)) => s.prefix_cache.clone(),
        _ => None,
    };
    tracing::info!(socket = %socket.display(), mlx = %info.mlx_version, device = %info.device, "worker listening");
    strata_runtime::shutdown::serve_until_signal(
        "worker",
        std::time::Duration::from_secs(3),
        |drain| {
            strata_runtime::uds::server()
                .add_service(WorkerServer::new(WorkerService::new(info, serving)))
                .serve_with_incoming_shutdown(incoming, drain)
        },
    )
    .await
    .context("gRPC server")?;
    let _ = std::fs::remove_file(&socket);
    // The blocks of the last requests go to the cache service before the process ends; the
    // gateway stops the service only after its workers.
    if let Some(cache) = prefix_cache {
        let queued = cache.stats.blocks_store_pending.load(Ordering::Relaxed);
        let left = cache.drain_stores(STORE_DRAIN).await;
        if left > 0 {
            tracing::warn!(
                left,
                "blocks still queued for the cache service at exit: lost"
            );
        } else if queued > 0 {
            tracing::info!(blocks = queued, "queued blocks stored before exit");
        }
    }
    Ok(())
}
