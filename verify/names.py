"""The names the command line offers (policies, pipelines, dtypes, torch parallelization cases),
free of torch so ``python -m verify --help`` answers at once. Each mirrors a registry that imports
torch; ``tests/harness/test_cli_startup.py`` checks that they agree."""

POLICY_NAMES = ("dp", "tp", "cp", "hybrid", "hybrid_cp", "random", "random2d", "cp_tp", "cp_tp_balanced", "ulysses",
                "cp_tp_ulysses", "autodist", "cp_balanced", "hybrid_cp_balanced", "cp_ring", "cp_ring_balanced", "cp_tp_ring",
                "cp_tp_ring_balanced")
"""``nnscaler.policies.POLICIES``, in its order."""

SEQUENCE_POLICIES = ("cp", "hybrid_cp", "cp_balanced", "hybrid_cp_balanced", "cp_tp", "cp_tp_balanced", "ulysses",
                     "cp_tp_ulysses",
                     "pp2_cp_tp", "pp2_cp_tp_balanced", "cp_ring", "cp_ring_balanced", "cp_tp_ring",
                     "cp_tp_ring_balanced", "pp2_cp_tp_ring", "pp2_cp_tp_ulysses")
"""Policies that split the tokens' sequence (context parallelism): ``verify all`` runs them on the models with a
sequence to split (``verify.sweep.selection.SEQUENCE_MODELS``); ``verify model`` only where named (``--policy cp``:
many models have no sequence)."""

PIPELINE_NAMES = ("pp", "pp_gpipe", "pp2_tp", "pp2_tp_gpipe", "pp2_dp", "pp2_dp_gpipe", "pp2_random", "pp2_hybrid",
                  "pp_interleaved", "pp_zb", "pp2_cp_tp", "pp2_cp_tp_balanced", "pp2_cp_tp_ring",
                  "pp2_cp_tp_ulysses")
"""``nnscaler.policies.pipeline.PIPELINE_POLICIES``, in its order."""

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
"""The ``torch`` dtypes a run may use (``verify.cases.samples.DTYPES`` is built from these)."""

TORCHPAR_NAMES = ("fsdp", "fsdp_tp", "hf_llama_tp_auto", "hf_qwen3_tp_auto", "titan_tp", "titan_tp_replicated_logits",
                  "titan_tp_wo_colwise", "vocab_offsets_v96", "wrong_missing_sp_gather", "wrong_rowwise_as_colwise",
                  "wrong_vocab_offsets")
"""The names of ``verify.rows.torchpar_builtin.CASES``, sorted."""

MODEL_NAMES = ("bert", "bucketed_mlp", "clip_tiny", "conv1d_net", "gemma", "gpt2", "gpt2_v96", "llama", "mixtral",
               "mixtral_batched", "mixtral_ep", "nanogpt", "padded_gpt", "phi3", "qwen3", "resnet_gn", "speech_encdec",
               "t5", "transformer_encoder", "vit", "weightnorm_mlp", "xlstm_tiny")
"""The names of ``verify.models.registry.MODELS`` (built-in, ``transformers`` installed), sorted."""

WIDENABLE_NAMES = ("bucketed_mlp", "clip_tiny", "conv1d_net", "gemma", "gpt2_v96", "llama", "mixtral",
                   "mixtral_batched", "mixtral_ep", "nanogpt", "padded_gpt", "phi3", "qwen3", "resnet_gn",
                   "speech_encdec", "t5", "transformer_encoder", "vit", "weightnorm_mlp", "xlstm_tiny")
"""The names of ``verify.models.registry.WIDENABLE`` (``NAME@WIDTH``), sorted."""

OVERWRITE = "overwrite"
"""``args.resume`` under ``--overwrite``, and ``ReportWriter(resume=OVERWRITE)``: the rows already in
the reports directory are replaced."""

MICROBATCH_POLICIES = ("dp", "tp")
"""The policies ``verify all`` trains with micro-batches (:mod:`verify.sweep.selection`)."""

SEEDED_POLICIES = ("random", "random2d", "pp2_random")
"""Policies whose plan is drawn from the seed: ``verify all --full`` runs each under every ``--random-seeds``."""

CACHE_DIR = ".verify-cache"
"""Where ``verify all`` keeps verdicts unless told (``--cache-dir``; :mod:`verify.sweep.cache`)."""

TWO_D_RESUME = {"dp": "hybrid", "tp": "random2d"}
"""At W=4 a checkpoint of these policies resumes under a 2-D plan (a 2 x 2 mesh; :mod:`verify.cases.resume`),
so a load that takes one mesh axis's coordinate for the other's is caught."""
