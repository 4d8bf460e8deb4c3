"""Model configs (config.json contents) for each architecture and size preset.

The big presets copy the shapes of real checkpoints (Qwen3-0.6B/8B/30B-A3B, Qwen2.5-0.5B/7B, Llama-3.2-1B,
Llama-3.1-8B, Mistral-7B-v0.3); `tiny` is a small model of the same architecture for CPU tests.
"""

from __future__ import annotations

from mlx_serve.errors import InvalidRequest

HF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")  # real-size presets, Hugging Face's layout
PRESETS = ("tiny", "0.6b", "8b", "30b-a3b")
DTYPES = ("bfloat16", "float16", "float32")

TINY_VOCAB = 2048
TINY_CONTEXT = 4096

_FAMILY_BASE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=TINY_CONTEXT,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
_GEMMA3 = dict(sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=32, rope_local_base_freq=10000.0,
               rms_norm_eps=1e-6)
_MINISTRAL3 = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"], rope_parameters={
    "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 32})
_V3_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, n_group=1,
               topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
_MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
_QWEN3_NEXT = dict(num_hidden_layers=4, full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2,
                   linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                   partial_rotary_factor=0.25)
# Gemma 4: full-attention layers with wider heads and partial proportional RoPE, a soft-capped head. The E2B/E4B
# form (gemma4_text here): per-layer inputs, and the last two layers read the K/V of the last earlier layer of their
# kind. The 26B/31B form (the gemma4 wrapper here): experts beside the MLP, full layers with one kv head whose keys
# are also its values (attention_k_eq_v)
_GEMMA4 = dict(num_hidden_layers=6, global_head_dim=64, sliding_window=16, final_logit_softcapping=4.0,
               tie_word_embeddings=True, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                      "sliding_attention", "sliding_attention", "full_attention"],
               rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                                      "rope_type": "default"}})
_GEMMA4_E = dict(_GEMMA4, num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=TINY_VOCAB)
_GEMMA4_MOE = dict(_GEMMA4, num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                   num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=64)
_GRANITE = dict(logits_scaling=8.0, attention_multiplier=0.05, embedding_multiplier=12.0, residual_multiplier=0.22)

# mlx-lm families served beyond the five above, at the tiny size only, written in mlx-lm's layout (`families`):
# model_type -> the keys its config adds to the base. Head scalings sit away from 1 where the family has them, so a
# test of log-probabilities sees them
MLX_FAMILIES: dict[str, dict] = {
    "phi3": dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.5] * 16},
                 original_max_position_embeddings=1024, partial_rotary_factor=1.0),
    "phimoe": dict(_MOE, rope_scaling=None),
    "granite": dict(_GRANITE),
    "granitemoe": dict(_GRANITE, **_MOE),
    "starcoder2": dict(norm_epsilon=1e-5, use_bias=True, hidden_act="gelu_pytorch_tanh"),
    "glm": dict(partial_rotary_factor=0.5),
    "glm4": dict(partial_rotary_factor=0.5),
    "stablelm": dict(partial_rotary_factor=0.25, layer_norm_eps=1e-5, use_qkv_bias=True),
    "mixtral": dict(_MOE),
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(_MOE, norm_topk_prob=False),
    "olmo2": dict(),
    "internlm2": dict(bias=False),
    "internlm3": dict(bias=False, qkv_bias=False),
    "minicpm": dict(dim_model_base=32, scale_depth=1.4, scale_emb=12.0),
    "helium": dict(),
    "seed_oss": dict(attention_out_bias=False),
    "nemotron": dict(hidden_act="relu2", norm_eps=1e-5, partial_rotary_factor=0.5),
    "gemma": dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    # attention scores and logits soft-capped by tanh: caps this low change the tokens and log-probabilities
    "gemma2": dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, query_pre_attn_scalar=32,
                   attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
    "cohere": dict(logit_scale=0.0625, layer_norm_eps=1e-5, use_qk_norm=True, tie_word_embeddings=True),
    "smollm3": dict(no_rope_layer_interval=2),
    "hunyuan_v1_dense": dict(use_qk_norm=True),
    "ernie4_5": dict(use_bias=False),
    "ernie4_5_moe": dict(use_bias=False, moe_num_experts=4, moe_k=2, moe_intermediate_size=64,
                         moe_layer_start_index=0),
    "deepseek": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                     first_k_dense_replace=1, moe_layer_freq=1),
    "mimo": dict(),
    "telechat3": dict(),
    "apertus": dict(post_norm=False, qk_norm=True, hidden_act="xielu"),
    # DeepSeek-V3-style routing (sigmoid scores, group-limited top-k, a shared expert) over standard attention
    "glm4_moe": dict(_V3_MOE, first_k_dense_replace=1, use_qk_norm=True, partial_rotary_factor=0.5, rope_scaling=None),
    "dots1": dict(_V3_MOE, first_k_dense_replace=1, scoring_func="noaux_tc"),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=0, rotary_dim=16),
    "afmoe": dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                  num_shared_experts=1, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "solar_open": dict(_V3_MOE, first_k_dense_replace=1, partial_rotary_factor=1.0),
    "exaone_moe": dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, n_group=1,
                       topk_group=1, routed_scaling_factor=1.0, sliding_window=16, num_shared_experts=1,
                       layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True]),
    "Klear": dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1),
    "nanbeige": dict(),
    "phi": dict(layer_norm_eps=1e-5),
    "laguna": dict(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, sliding_window=16),
    # Hunyuan-A13B: MoE beside a dense MLP, cross-layer attention (a layer reuses the one before's K/V projections)
    "hunyuan": dict(moe_topk=2, num_experts=4, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
                    use_cla=True, cla_share_factor=2, moe_intermediate_size=64,
                    rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}),
    "bailing_moe": dict(num_experts=4, num_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
                        norm_topk_prob=True, first_k_dense_replace=1, topk_group=1, use_qk_norm=True,
                        moe_shared_expert_intermediate_size=64),
    # multi-head latent attention (`mla_attention`): a latent and a RoPE key cached a token
    "deepseek_v3": dict(_V3_MOE, **_MLA, first_k_dense_replace=1, moe_layer_freq=1),
    "kimi_k2": dict(_V3_MOE, **_MLA, first_k_dense_replace=1, moe_layer_freq=1),  # mlx-lm runs it as deepseek_v3
    "glm4_moe_lite": dict(_V3_MOE, **_MLA, first_k_dense_replace=1, moe_layer_freq=1),
    # and Llama 4's query scaling by position (from position 32 here), YaRN RoPE
    "mistral4": dict(_V3_MOE, **_MLA, first_k_dense_replace=1, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 32,
        "llama_4_scaling_beta": 0.5, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # the expanded form: every head's key (no-RoPE and RoPE parts) and a shorter value cached, YaRN RoPE
    "deepseek_v2": dict(_V3_MOE, **{**_MLA, "v_head_dim": 24}, first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy",
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "minicpm3": dict(q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, kv_lora_rank=32, dim_model_base=32,
                     scale_depth=1.4, scale_emb=12.0, rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                     "long_factor": [1.5] * 8, "original_max_position_embeddings": 1024}),
    "exaone": dict(num_layers=2, layer_norm_epsilon=1e-5),
    "gpt2": dict(n_ctx=TINY_CONTEXT, n_embd=128, n_head=4, n_layer=2, n_positions=TINY_CONTEXT,
                 layer_norm_epsilon=1e-5, num_key_value_heads=None),
    "nanochat": dict(),
    "kimi_k25": dict(text_config={"model_type": "deepseek_v3", **_FAMILY_BASE, **_V3_MOE, **_MLA,
                                  "first_k_dense_replace": 1, "moe_layer_freq": 1}),  # Kimi K2.5: DeepSeek-V3 inside
    "qwen2_vl": dict(text_config={"model_type": "qwen2", **_FAMILY_BASE}),  # Qwen2-VL's text half
    "pixtral": dict(text_config={"model_type": "llama", **_FAMILY_BASE}),  # Pixtral's text half
    # Qwen3-VL's multimodal checkpoints: their text half is a Qwen3 (or Qwen3-MoE) model
    "qwen3_vl": dict(text_config={"model_type": "qwen3", **_FAMILY_BASE}),
    "qwen3_vl_moe": dict(text_config={"model_type": "qwen3_moe", **_FAMILY_BASE, **_MOE, "decoder_sparse_step": 1,
                                      "mlp_only_layers": []}),
    # sliding-window layers (16 tokens here, so tests' prompts cross them)
    "gemma3_text": dict(_GEMMA3),
    "gemma3": dict(text_config={"model_type": "gemma3_text", **_FAMILY_BASE, **_GEMMA3}),  # a multimodal wrapper
    "olmo3": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(sliding_window=16, sliding_window_pattern=2, logit_scale=0.0625, layer_norm_eps=1e-5,
                    tie_word_embeddings=True),
    "ministral3": dict(_MINISTRAL3),
    "mistral3": dict(text_config={"model_type": "ministral3", **_FAMILY_BASE, **_MINISTRAL3}),  # a multimodal wrapper
    # Gemma 3n: AltUp, learned residuals, per-layer inputs, sparse activations in the first MLPs, and its last two
    # layers reading the K/V of the last earlier layer of their kind; its language model's forward ends in its head
    "gemma3n": dict(text_config={"model_type": "gemma3n_text", **_FAMILY_BASE, "num_hidden_layers": 6,
                                 "num_kv_shared_layers": 2, "vocab_size_per_layer_input": TINY_VOCAB,
                                 "sliding_window": 16, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 4.0,
                                 "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                 "sliding_attention", "sliding_attention", "full_attention"],
                                 "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
                                 "hidden_size_per_layer_input": 16, "altup_num_inputs": 4, "altup_coef_clip": 120.0,
                                 "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 16,
                                 "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma4_text": dict(_GEMMA4_E),
    "gemma4": dict(text_config={"model_type": "gemma4_text", **_FAMILY_BASE, **_GEMMA4_MOE}),  # a multimodal wrapper
    # and attention sinks (a per-head logit in every softmax)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16, rope_scaling=None,
                    layer_types=["sliding_attention", "full_attention"]),
    # Step 3.5: sliding layers with more heads (attention_other_setting), a gate a head, zero-centred norms, experts
    "step3p5": dict(num_attention_groups=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 4},
                    partial_rotary_factors=[1.0, 0.5], moe_num_experts=4, moe_top_k=2, moe_intermediate_size=64,
                    share_expert_dim=64, moe_layers_enum="1"),
    # MiMo-V2-Flash: sliding layers with more, narrower heads than the full ones, values shorter than keys in both,
    # attention sinks in the sliding ones; sigmoid-routed experts
    "mimo_v2_flash": dict(num_experts_per_tok=2, hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1],
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, sliding_window_size=16,
                          moe_intermediate_size=64, n_shared_experts=None, n_routed_experts=4,
                          routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
                          norm_topk_prob=True, n_group=1, topk_group=1, layernorm_epsilon=1e-5,
                          swa_rope_theta=10000.0, swa_num_attention_heads=8, swa_num_key_value_heads=4, head_dim=48,
                          v_head_dim=32, swa_head_dim=32, swa_v_head_dim=24, partial_rotary_factor=0.5),
    "mellum": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                   sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 1000000.0}}),
    # recurrent layers beside attention (`mlx_serve.recurrent`): gated delta nets, short convolutions, Mamba-2
    "qwen3_next": dict(_QWEN3_NEXT, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                       shared_expert_intermediate_size=64, moe_intermediate_size=64, norm_topk_prob=True),
    "qwen3_5": dict(_QWEN3_NEXT, rope_parameters={"type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}),
    "qwen3_5_moe": dict(_QWEN3_NEXT, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                        moe_intermediate_size=64, rope_parameters={"type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}),
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5, conv_bias=False,
                 conv_L_cache=3, block_dim=128, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, block_ff_dim=256),
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5,
                     conv_bias=False, conv_L_cache=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                     norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1),
    "granitemoehybrid": dict(_GRANITE, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128, mamba_n_heads=4,
                             mamba_d_head=64, mamba_expand=2, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                             mamba_n_groups=1, mamba_conv_bias=True, tie_word_embeddings=True),
    "olmo_hybrid": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True),
    "nemotron_h": dict(num_hidden_layers=5, hybrid_override_pattern=["M", "*", "-", "M", "E"], mamba_num_heads=4,
                       mamba_head_dim=32, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1,
                       mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, n_routed_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
                       n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0),
    # a Mamba-2 mixer and attention side by side in every layer (one `CacheList` each)
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_d_conv=4,
                      mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=1, mlp_expansion_factor=2,
                      key_multiplier=0.5, embedding_multiplier=2.0, lm_head_multiplier=0.5, ssm_in_multiplier=1.25,
                      ssm_out_multiplier=0.25, tie_word_embeddings=True),
    # recurrent layers only (no K/V: the pool's blocks only count positions)
    "mamba": dict(state_size=16, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
                  tie_word_embeddings=True),
    "mamba2": dict(num_heads=4, head_dim=64, state_size=16, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                   use_bias=False, use_conv_bias=True, tie_word_embeddings=True, time_step_limit=[0.0, 1e9],
                   time_step_rank=8, expand=2),
    # RWKV-7: a layer's time mixing and channel mixing read one state, and pass v_first on from the first layer
    "rwkv7": dict(norm_eps=1e-5, a_low_rank_dim=16, v_low_rank_dim=16, gate_low_rank_dim=32, decay_low_rank_dim=16),
    "jamba": dict(num_hidden_layers=4, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, num_experts=4,
                  num_experts_per_tok=2, tie_word_embeddings=True),
    # Llama 4 (a multimodal wrapper): chunked attention in three layers of four (16-token chunks here), the fourth
    # without RoPE and its queries scaled up with the position (from position 15 here: floor_scale 16); top-1 experts
    "llama4": dict(text_config={"model_type": "llama4_text", **_FAMILY_BASE, "num_hidden_layers": 4,
                                "attention_chunk_size": 16, "interleave_moe_layer_step": 2, "intermediate_size": 64,
                                "intermediate_size_mlp": 256, "num_local_experts": 4, "num_experts_per_tok": 1,
                                "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 16,
                                "attn_scale": 0.1, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 1024}}),
    # EXAONE 4: three sliding layers with RoPE, then a global one without. mlx-lm reads the pattern string, transformers
    # (the tokenizer's config) the layer types: a real checkpoint carries both
    "exaone4": dict(num_hidden_layers=4, sliding_window=16, sliding_window_pattern="LLLG",
                    layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_scaling=None),
    # GPT-NeoX (Pythia): fused q/k/v per head, RoPE over a quarter of each head, attention and MLP in parallel
    "gpt_neox": dict(num_key_value_heads=None, layer_norm_eps=1e-5, rotary_emb_base=10000, rotary_pct=0.25,
                     use_parallel_residual=True),
}

ARCHS = (*HF_ARCHS, *MLX_FAMILIES)

_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
}

_TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": TINY_VOCAB,
    "max_position_embeddings": TINY_CONTEXT,
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (arch, preset) -> the shape keys of the real checkpoint it imitates
_REAL_SHAPES: dict[tuple[str, str], dict] = {
    ("qwen3", "0.6b"): dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    ("qwen3", "8b"): dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    ("qwen3_moe", "30b-a3b"): dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    ("qwen2", "0.6b"): dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    ("qwen2", "8b"): dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    ("llama", "0.6b"): dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
    ("llama", "8b"): dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
    ),
    ("mistral", "8b"): dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
}

_REFUSALS = {
    ("mistral", "0.6b"): "Mistral has no model near 0.6B; use --preset tiny or 8b",
    ("mistral", "30b-a3b"): "30b-a3b is a mixture-of-experts preset; use --arch qwen3_moe",
    ("llama", "30b-a3b"): "30b-a3b is a mixture-of-experts preset; use --arch qwen3_moe",
    ("qwen2", "30b-a3b"): "30b-a3b is a mixture-of-experts preset; use --arch qwen3_moe",
    ("qwen3", "30b-a3b"): "30b-a3b is a mixture-of-experts preset; use --arch qwen3_moe",
    ("qwen3_moe", "0.6b"): "Qwen3-MoE has no 0.6B model; use --preset tiny or 30b-a3b",
    ("qwen3_moe", "8b"): "Qwen3-MoE has no 8B model; use --preset tiny or 30b-a3b",
}


def _family_defaults(arch: str) -> dict:
    """Keys every checkpoint of the family carries, as the Hugging Face configs spell them."""
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        base = dict(
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=28,
        )
        if arch != "qwen2":
            base["attention_bias"] = False
        if arch == "qwen3_moe":
            base.update(
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
                output_router_logits=False,
                router_aux_loss_coef=0.001,
            )
        return base
    if arch == "llama":
        return dict(
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=None,
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            initializer_range=0.02,
            pretraining_tp=1,
            use_cache=True,
        )
    return dict(
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )


def _tiny_shape(arch: str) -> dict:
    shape = dict(_TINY_SHAPE, tie_word_embeddings=arch in ("qwen2", "qwen3"))
    if arch == "qwen2":
        shape.pop("head_dim")  # Qwen2 derives head_dim from hidden_size / heads
    if arch == "qwen3_moe":
        shape.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    return shape


def check_combo(arch: str, preset: str, dtype: str = "float32") -> None:
    """Raise InvalidRequest, with the reason, for an architecture/preset/dtype that make no sense together."""
    if arch not in ARCHS:
        raise InvalidRequest(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise InvalidRequest(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise InvalidRequest(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if arch in MLX_FAMILIES and preset != "tiny":
        raise InvalidRequest(f"--arch {arch} has only --preset tiny (its real sizes are not among the presets)")
    if (arch, preset) in _REFUSALS:
        raise InvalidRequest(f"--arch {arch} --preset {preset} makes no sense: {_REFUSALS[arch, preset]}")


def model_config(arch: str, preset: str, dtype: str = "float32") -> dict:
    """The config.json of the checkpoint (without tokenizer ids, which `token_ids_config` adds)."""
    check_combo(arch, preset, dtype)
    if arch in MLX_FAMILIES:
        family = MLX_FAMILIES[arch]
        # a multimodal wrapper's config holds the text model's keys in text_config, as real ones do
        base = {"vocab_size": TINY_VOCAB} if "text_config" in family else _FAMILY_BASE
        return {"model_type": arch, **base, **family, "torch_dtype": dtype}
    shape = _tiny_shape(arch) if preset == "tiny" else dict(_REAL_SHAPES[arch, preset])
    config = {"architectures": [_HF_CLASS[arch]], "model_type": arch, **_family_defaults(arch), **shape}
    config["torch_dtype"] = dtype
    if arch in ("qwen3", "qwen3_moe"):
        config["max_window_layers"] = shape["num_hidden_layers"]
    return config
