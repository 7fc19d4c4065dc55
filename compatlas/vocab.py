"""The closed sets of compatlas's vocabulary, each named once: a ``Literal`` type and its tuple.

Every module that checks, loops over or orders these values imports them from here, so the
kernel, the workflow, the report and the tests cannot disagree on what a metric or a space
is. The order of each tuple is the order tables, loops and the report use. The config schema
(``workflow/schemas/config.schema.yaml``) repeats some of them as enums, because JSON Schema
cannot import Python; ``tests/test_vocab.py`` checks every enum there against this module.

This module imports nothing but ``typing``: the CLI, the report and the Snakefile read it
without loading torch. (The pattern is TransformerLens's ``head_detector.py``:
``HeadName = Literal[...]``, ``HEAD_NAMES = get_args(HeadName)``.)
"""

from __future__ import annotations

from typing import Literal, get_args

NormalisedMetric = Literal["frobenius", "svd_bound", "subspace"]
"""The metrics in [0, 1] that Lieberum's axioms and a Gaussian null are about (a magnitude has neither)."""
NORMALISED_METRICS: tuple[NormalisedMetric, ...] = get_args(NormalisedMetric)

KernelMetric = Literal[NormalisedMetric, "contribution"]
"""The metrics the composition kernel computes from the weights (and, in the activation space, the
moments), in every space (``compatlas.composition.scores``): the normalised three and ``contribution``."""
KERNEL_METRICS: tuple[KernelMetric, ...] = get_args(KernelMetric)

ActivationOnlyMetric = Literal["pattern_output"]
"""Metrics of the model's own forward pass, which exist only in the ``activation`` space: a
composition job of another space has nothing to score (the plan leaves those cells out)."""
ACTIVATION_ONLY_METRICS: tuple[ActivationOnlyMetric, ...] = get_args(ActivationOnlyMetric)

MagnitudeMetric = Literal["contribution", "pattern_output"]
"""The magnitudes (no Gaussian null, a ``score_share``): ``contribution``, the RMS of what a writer
adds to the reader's logit or output, and ``pattern_output``, the first-order change of the reader's
output through its attention pattern (Q, K) or values (V) (``compatlas.composition.pattern_output``)."""
MAGNITUDE_METRICS: tuple[MagnitudeMetric, ...] = get_args(MagnitudeMetric)

Metric = Literal[KernelMetric, ActivationOnlyMetric]
"""How a writer/reader head pair's composition is scored: the three normalised scores and two
magnitudes, ``contribution`` and ``pattern_output`` (activation space only)."""
METRICS: tuple[Metric, ...] = get_args(Metric)

TokenSpace = Literal["token", "token_norm"]
"""The token basis of W_E (``token_norm``: W_E's rows as the first attention norm sees them;
``compatlas.composition.token_space``)."""
TOKEN_SPACES: tuple[TokenSpace, ...] = get_args(TokenSpace)

WeightSpace = Literal["residual", TokenSpace]
"""The spaces computed from the weights alone (the audits' spaces)."""
WEIGHT_SPACES: tuple[WeightSpace, ...] = get_args(WeightSpace)

Space = Literal[WeightSpace, "activation"]
"""The basis the scores are taken in: the residual stream, a token basis, or the model's own
activation statistics over a text sample (``compatlas.composition.activation_space``)."""
SPACES: tuple[Space, ...] = get_args(Space)

TextKind = Literal["stdlib", "file", "hub", "induction"]
"""Where the activation space's text sample comes from (``compatlas.composition.text_sample``)."""
TEXT_KINDS: tuple[TextKind, ...] = get_args(TextKind)

Comp = Literal["Q", "K", "V"]
"""Which input of the reader head reads the writer's output: its query, key or value."""
COMPS: tuple[Comp, ...] = get_args(Comp)

Transform = Literal["permutation", "orthogonal", "orthogonal_scale", "diagonal", "gl"]
"""Classes of change of residual basis ``x -> x T`` of the invariance audit (``compatlas.audits.invariance``)."""
TRANSFORMS: tuple[Transform, ...] = get_args(Transform)

SourceKind = Literal["hub", "local", "gguf", "build", "trained"]
"""Where a model's weights come from (``compatlas.models.loading``). ``trained`` is never written in a
config: the config turns each training run into a model of that kind."""
SOURCE_KINDS: tuple[SourceKind, ...] = get_args(SourceKind)
CONFIG_SOURCE_KINDS: tuple[SourceKind, ...] = tuple(k for k in SOURCE_KINDS if k != "trained")

Processing = Literal["none", "compat"]
"""Weight processing before extraction: raw weights, or TransformerLens's compatibility mode
(norms folded, writing weights centred)."""
PROCESSINGS: tuple[Processing, ...] = get_args(Processing)

NormGains = Literal["fold", "raw"]
"""What extraction does with the per-channel gains of QK-norm and the post-attention norm
(``compatlas.models.norm_gains``): fold them into W_Q / W_K columns and W_O output channels, or keep raw."""
NORM_GAINS: tuple[NormGains, ...] = get_args(NormGains)

NullStratify = Literal["none", "distance"]
"""Which null pairs a causal pair is calibrated against: all of its group's, or only those at
the same layer distance (``compatlas.composition.calibration``)."""
NULL_STRATIFY: tuple[NullStratify, ...] = get_args(NullStratify)

NullPairs = Literal["mirror", "mirror_and_same_layer"]
"""Which non-causal pairs make the null: the causal pairs' anti-causal mirror image, or that and
the same-layer pairs of distinct heads (a stricter test; ``compatlas.composition.calibration``)."""
NULL_PAIRS: tuple[NullPairs, ...] = get_args(NullPairs)

TestUnit = Literal["query_head", "kv_head"]
"""What one calibrated test is: a writer head x reader query head, or a writer head x reader KV
head where the score cannot differ across the query heads of a KV group (``compatlas.composition.calibration``)."""
TEST_UNITS: tuple[TestUnit, ...] = get_args(TestUnit)

AblationMode = Literal["zero", "mean"]
"""What an ablated head's output is replaced by (``compatlas.behaviour.induction.ablation_effects``)."""
ABLATION_MODES: tuple[AblationMode, ...] = get_args(AblationMode)

AblationMethod = Literal["exact", "attribution", "full"]
"""How the ablation drop is computed. ``full`` (whole-model reruns) is the reference the
tests and benchmarks compare ``exact`` with; the config offers ``exact`` and ``attribution``."""
ABLATION_METHODS: tuple[AblationMethod, ...] = get_args(AblationMethod)
CONFIG_ABLATION_METHODS: tuple[AblationMethod, ...] = ("exact", "attribution")

EdgeMethod = Literal["eap", "eap_attn", "eap_ig"]
"""How every edge's effect is estimated (``compatlas.function.edge_attribution``): edge attribution
patching; the same with the attention softmax of Q and K edges computed exactly (AtP*'s QK fix,
``compatlas.function.eap_attn``); or with integrated gradients. Exact patching measures a sample beside them."""
EDGE_METHODS: tuple[EdgeMethod, ...] = get_args(EdgeMethod)
ExactPatchingKey = Literal["exact_edges", "exact_sequences", "exact_top"]
"""The settings of ``induction.edge_attribution`` that exact patching alone reads: an attribution job
over a share of the sequences does not (changing them reruns only the edge attribution job)."""
EXACT_PATCHING_KEYS: tuple[ExactPatchingKey, ...] = get_args(ExactPatchingKey)

Architecture = Literal["gpt2", "llama"]
"""The shapes a built or trained small model takes (GPT-2: learned positions, LayerNorm;
Llama: rotary, RMSNorm)."""
ARCHITECTURES: tuple[Architecture, ...] = get_args(Architecture)

TrainingData = Literal["repeat", "copy"]
"""The synthetic sequences a training run learns induction on (``compatlas.models.training``)."""
TRAINING_DATA: tuple[TrainingData, ...] = get_args(TrainingData)

Device = Literal["auto", "cpu", "cuda"]
"""Where the kernels run (``compatlas.runtime.resolve_device``)."""
DEVICES: tuple[Device, ...] = get_args(Device)

ForwardDtype = Literal["auto", "float32", "bfloat16", "float16"]
"""Precision of the induction forward passes (``auto``: bfloat16 on a GPU, float32 on the CPU)."""
FORWARD_DTYPES: tuple[ForwardDtype, ...] = get_args(ForwardDtype)

Role = Literal["A", "B"]
"""The token an induction power is measured for: the first (A) or second (B) of ``A B .. A``."""
ROLES: tuple[Role, ...] = get_args(Role)

ScoreDtype = Literal["float32", "float64", "tf32", "bf16"]
"""Precision of the composition kernels (``dtype`` in the config): ``tf32`` and ``bf16`` round the
inputs of the core products only, with float32 accumulation (``compatlas.composition.precision``)."""
SCORE_DTYPES: tuple[ScoreDtype, ...] = get_args(ScoreDtype)

DeviceMap = Literal["none", "auto", "balanced"]
"""How a model larger than one GPU is spread over the node's GPUs for forward passes
(Hugging Face's ``device_map``; ``none``: one device)."""
DEVICE_MAPS: tuple[DeviceMap, ...] = get_args(DeviceMap)

CpuMatmul = Literal["onednn", "blas"]
"""Which library multiplies float32 matrices on the CPU in the behaviour jobs (``induction.cpu_matmul``,
``compatlas.models.cpu_matmul``): oneDNN, whose kernels follow the CPU's instructions (AVX-512 on an AMD
CPU too), or torch's own BLAS (MKL on x86, its AVX2 path on AMD CPUs)."""
CPU_MATMULS: tuple[CpuMatmul, ...] = get_args(CpuMatmul)
