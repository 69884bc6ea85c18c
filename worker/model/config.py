"""The model facts the worker needs, read from GGUF metadata or a Hugging Face config.json.

One ModelConfig describes every supported family; the per-family details are switches on it (rope
scaling, sliding windows, q/k norms, soft-caps, sandwich norms, attention sinks, the activation, the experts of a
mixture of experts and their routing), so model.py has one forward pass and no architecture names in it.
"""
from __future__ import annotations

from dataclasses import dataclass

# the last four: mixtures of experts (worker.model.moe)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                           "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
# freq_factors: llama.cpp's rope_freqs tensor (how its converter stores llama3 scaling), each frequency divided by its factor
ROPE_SCALING_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """rope_scaling / rope_parameters as transformers reads them (worker.model.rope turns it into frequencies)."""

    rope_type: str  # one of ROPE_SCALING_TYPES other than "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3 / yarn / longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn / longrope: cos/sin multiplier (None: derived from factor)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: beyond it
    freq_factors: tuple[float, ...] = ()  # freq_factors: one divisor per frequency

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES or self.rope_type == "default":
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
        needs_original = self.rope_type in ("llama3", "yarn", "longrope")
        if needs_original and not self.original_max_position_embeddings:
            raise ValueError(f"rope scaling {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("rope scaling 'longrope' needs short_factor and long_factor")
        if self.rope_type == "freq_factors" and not self.freq_factors:
            raise ValueError("rope scaling 'freq_factors' needs freq_factors")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES; all share one forward pass
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP inner width (gate/up output)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads (GQA: num_heads is a multiple of it)
    head_dim: int  # may differ from hidden_size / num_heads (gemma, qwen3)
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool  # lm_head reuses the input embedding
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (on the global layers when local_rope_theta is set)
    local_rope_theta: float | None = None  # gemma3: the sliding-window layers use plain RoPE at this base
    # per layer: the sliding window (a token attends to the last `window` positions, itself included)
    # or None for full attention; () means every layer is full attention
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # qwen3 / gemma3: RMSNorm over each head of q and k before RoPE
    sandwich_norms: bool = False  # gemma2/3: post-attention and post-feedforward norms on the branch outputs
    hidden_act: str = "silu"  # one of ACTIVATIONS, applied to the gate
    embedding_multiplier: float | None = None  # gemma: token embeddings times sqrt(hidden_size)
    attn_logit_softcap: float | None = None  # gemma2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # gemma2: logits = cap * tanh(logits / cap)
    query_scale: float | None = None  # attention score scale; None: head_dim ** -0.5
    qk_norm_whole: bool = False  # olmoe: the q/k RMSNorms span the whole projection (q_size / kv_size), not a head
    # mixture of experts (worker.model.moe); num_experts 0: every layer is a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's gate/up width
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1 (mixtral always)
    router_weights_float: bool = False  # mixtral: routing weights stay float32 (qwen3_moe/olmoe: the model dtype)
    dense_mlp_layers: tuple[int, ...] = ()  # qwen3_moe's mlp_only_layers / decoder_sparse_step: dense MLP there
    # gpt-oss: a learned logit per query head that joins every attention softmax's denominator (no value), so a
    # head can attend to "nothing"; the attention output projection's bias; the router's bias, its top-k taken over
    # the raw logits and the softmax over the k chosen; the experts' biases and their clamped SwiGLU
    attention_sinks: bool = False
    attention_out_bias: bool = False
    router_bias: bool = False
    router_topk_first: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: the experts' plain act(gate) * up; else gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702  # its sigmoid gain: gate * sigmoid(alpha * gate)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be positive for a mixture of experts")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the sparse mixture of experts (else a dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def every_layer_window(self) -> int | None:
        """The window all layers attend within (the largest, if they differ), or None when any layer
        attends the whole context: a global layer still reads every page, so none can be given back."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)
