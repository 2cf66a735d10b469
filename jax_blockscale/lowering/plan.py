"""The planner: which backend, kernel, variant, tile and split count run one gemm problem.

`plan(spec, platform, requested)` is called once per lowering of `gemm_p` and returns a `Plan`;
the chosen backend then carries the plan out (lowering/ffi_sm90.py, lowering/ffi_sm100.py,
lowering/reference.py) without deciding anything again. Every decision reads the architecture's
catalogue (jax_blockscale/catalog/) and the configuration (jax_blockscale/config.py); the C++
handler receives the chosen variant as FFI attributes and only validates and launches it.

  * Backend: a forced one (`backend=` or JAX_BLOCKSCALE_BACKEND), else the highest-priority
    registered backend serving the platform whose `plan` accepts the problem (sm100 > sm90 >
    reference); each one skipped is logged once with its reason.
  * sm90 (`plan_sm90`): past the fused kernel's measured row limit, dequantize + a bf16 GEMM
    (XLA's dot, or the cuBLASLt dot_alpha target when alpha must scale the f32 sum first);
    otherwise whether a quantized activation is dequantized to bf16 first, whether the weights
    go to wgmma's registers (register-weight variants, activation K-permuted), the decode
    kernel's split-K count (0: a fused variant), and the tile.
  * sm100 (`plan_sm100`): the variant (tile, cluster) by the catalogue's cost model.

The plan depends on the device's SM count (the decode kernel's splits fill one wave; tiles fill
the SMs). Lowered without a GPU (jax.export on a CPU host, tests) it uses the catalogue's default
SM count; a plan made for one SM count runs correctly on any device of the architecture (the
persistent grids and cluster counts take the device's SM count at launch).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np

from .. import _plugin
from .. import config as _config
from ..catalog import sm90 as cat90
from ..catalog import sm100 as cat100
from .registry import (backends_for, forced_backend, get_backend, get_ragged_backend, log_once,
                       ragged_backend_names, ragged_backends)
from .specs import Device, GemmSpec, Plan, RaggedPlan, RaggedSpec
from .kernel_operands import kernel_rows_and_batch
from .reference import DIRECT_OUTPUT_MIN_OUTPUTS, direct_output, gemm_outputs

_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# The device


@functools.lru_cache(maxsize=None)
def _gpu_device() -> Device:
    """The visible CUDA GPUs as one Device (all must share an architecture)."""
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:  # no GPU backend at all
        return Device("cuda", None, 0, f"no CUDA devices ({e})")
    if not gpus:
        return Device("cuda", None, 0, "no CUDA devices")
    ccs = sorted({str(getattr(d, "compute_capability", "?")) for d in gpus})
    sms = max((getattr(d, "core_count", 0) or 0) for d in gpus)
    if ccs == ["9.0"]:
        cards = {cat90.card_of(getattr(d, "device_kind", "")) for d in gpus}
        return Device("cuda", "sm90", sms or cat90.DEFAULT_SM_COUNT,
                      card=cards.pop() if len(cards) == 1 else None)
    if set(ccs) <= set(cat100.BLACKWELL_CCS):
        return Device("cuda", "sm100", sms or cat100.DEFAULT_SM_COUNT)
    return Device("cuda", None, sms, f"no kernels for compute capability {', '.join(ccs)} (sm90 "
                  "needs 9.0; sm100 needs 10.0 or 10.3)")


def device_for(platform: str) -> Device:
    if platform == "cuda":
        return _gpu_device()
    return Device(platform, None, 0, f"platform {platform!r} has no kernels")


# ---------------------------------------------------------------------------------------------
# Choosing the backend


def plan(spec: GemmSpec, platform: str, requested: str | None = None) -> Plan:
    """The Plan for `spec` on `platform` (see the module docstring). A shard of a sharded call
    (`spec.plan_shape`) runs the unsharded call's plan where the same backend takes both."""
    if spec.plan_shape is not None:
        own = plan(dataclasses.replace(spec, plan_shape=None), platform, requested)
        try:
            whole = plan(unsharded(spec), platform, requested)
        except ValueError:  # a forced backend that cannot run the whole call still runs a shard
            return own
        return as_shard(whole, spec) if whole.backend == own.backend else own
    device = device_for(platform)
    name = forced_backend(requested)
    if name is not None:
        backend = get_backend(name)
        if platform not in backend.platforms:
            raise ValueError(f"gemm backend {name!r} does not run on platform {platform!r} "
                             f"(it serves {backend.platforms})")
        p = backend.plan(spec, device)
        if isinstance(p, str):
            raise ValueError(f"gemm backend {name!r} cannot run this problem: {p}")
        return dataclasses.replace(p, platform=platform)
    for backend in backends_for(platform):
        p = backend.plan(spec, device)
        if not isinstance(p, str):
            log_once(logging.DEBUG, "gemm on %s uses backend %s (%s)", platform, backend.name,
                     p.kernel)
            return dataclasses.replace(p, platform=platform)
        log_once(logging.INFO, "gemm backend %s skipped on %s: %s", backend.name, platform, p)
    raise ValueError(f"no gemm backend can run this problem on {platform!r}")


def unsharded(spec: GemmSpec) -> GemmSpec:
    """The unsharded problem a shard (`spec.plan_shape`) belongs to."""
    a_batch, b_batch, m, n = spec.plan_shape
    return dataclasses.replace(spec, a_batch=a_batch, b_batch=b_batch, m=m, n=n, plan_shape=None,
                               batch_shape=tuple(np.broadcast_shapes(a_batch, b_batch)))


def as_shard(whole: Plan, spec: GemmSpec) -> Plan:
    """The unsharded call's plan `whole` run on the shard `spec`: the same kernel, variant, tile
    and split count (so every output element is summed in the same order), over the shard's own
    rows, batch and split-K workspace. Every kernel takes any smaller M, N and batch."""
    m, l = kernel_rows_and_batch(spec)
    workspace = whole.splits * l * m * spec.n  # decode or split register-weight: per split
    return dataclasses.replace(whole, spec=spec, m=m, l=l, workspace=workspace)


def select_ragged_backend(spec: RaggedSpec, platform: str, requested: str | None) -> RaggedPlan:
    """The plan for `spec` on `platform`: the forced backend (`requested`, else the
    JAX_BLOCKSCALE_BACKEND variable when it names a ragged backend), else the highest-priority
    registered backend serving the platform that accepts the problem. Skips are logged once."""
    if requested in (None, "auto"):
        env = _config.get().backend
        if env is not None and env not in ragged_backend_names():
            log_once(logging.INFO, "jax_blockscale ragged_gemm: JAX_BLOCKSCALE_BACKEND=%s has no "
                      "ragged_gemm implementation; choosing automatically", env)
            env = None
        requested = env
    if requested not in (None, "auto"):
        backend = get_ragged_backend(requested)
        if platform not in backend.platforms:
            raise ValueError(f"ragged_gemm backend {requested!r} does not run on {platform} "
                             f"(it serves {backend.platforms})")
        plan = backend.plan(spec, platform)
        if isinstance(plan, str):
            raise ValueError(f"ragged_gemm backend {requested!r} cannot run this problem: {plan}")
        return plan
    candidates = sorted((b for b in ragged_backends() if platform in b.platforms),
                        key=lambda b: -b.priority)
    for backend in candidates:
        plan = backend.plan(spec, platform)
        if not isinstance(plan, str):
            return plan
        log_once(logging.INFO, "jax_blockscale ragged_gemm: backend %s skipped: %s",
                  backend.name, plan)
    raise ValueError(f"no ragged_gemm backend serves platform {platform!r}")


# ---------------------------------------------------------------------------------------------
# What the loaded library holds (a fake stands in for it in the planner's tests)


class Library:
    """The variant names and targets of libjax_blockscale.so, read through `_plugin`."""

    def unavailable_reason(self) -> str | None:
        return _plugin.unavailable_reason()

    def sm100_unavailable_reason(self) -> str | None:
        return _plugin.sm100_unavailable_reason()

    def has_dot_alpha(self) -> bool:
        return _plugin.has_dot_alpha()

    def has_ragged_sm100(self) -> bool:
        return _plugin.has_ragged_sm100()

    def has_layer_gemm(self) -> bool:
        return _plugin.has_layer_gemm()

    def has_quantized_act_gemm(self) -> bool:
        return _plugin.has_quantized_act_gemm()

    def has_quantize_nvfp4(self) -> bool:
        return _plugin.has_quantize_nvfp4()

    def has(self, variant_name: str) -> bool:
        return variant_name in _plugin.variant_names()


LIBRARY = Library()


# ---------------------------------------------------------------------------------------------
# gemm(x, w, quantize_a=...): the quantizer kernels and gemm's plan in one call


def plan_quantized_activation(spec: GemmSpec, platform: str, backend, library=LIBRARY):
    """`gemm(x, w, quantize_a=...)`'s plan (dense/quantized_activation.py): gemm's plan for the
    composed problem `spec` when the fused target (the quantizer kernels, then that plan, in one
    FFI call) can carry it out, else None: the composition runs. It can where the plan is the
    sm90 decode kernel reading plain NVFP4 activation scales or the register-weight kernel
    reading the activation dequantized in its K order (which the quantizer then writes), for one
    matrix with K unpadded, whether the activation's global scale is given or calibrated, at any
    size."""
    if (platform != "cuda" or spec.fmt_a not in cat90.QUANTIZE_A_FORMATS
            or np.dtype(spec.a_dtype) != np.dtype(jnp.float4_e2m1fn)
            or library.unavailable_reason() is not None or not library.has_quantized_act_gemm()):
        return None
    p = plan(spec, platform, backend)
    if p.backend != "sm90" or p.l != 1 or p.k != spec.k:
        return None
    decode = (p.kernel == "decode" and p.a_scales_plain and not p.dequantize_a
              and not p.permute_k and library.has(chained_decode_name(p)))
    register_weights = (p.kernel == "register_weights" and p.dequantize_a and p.permute_k
                        and p.a_kind == "bf16_kperm")
    return p if decode or register_weights else None


def chained_decode_name(p) -> str:
    """The chained twin (DecodeVariant.chained) of the decode variant plan `p` runs: what the
    fused target launches behind the quantizer."""
    out = cat90.OUT_OF_DTYPE[np.dtype(p.spec.out_dtype).name]
    return cat90.DecodeVariant(p.a_kind, p.b_kind, out, p.nt, chained=True).name


# ---------------------------------------------------------------------------------------------
# jbs.quantize's NVFP4 quantizer


def plan_quantize_nvfp4(x_aval, platform: str, library=LIBRARY) -> str:
    """Where `quantize_nvfp4_p` (jax_blockscale/quantization) runs x (M, K): "sm90", the quantizer
    kernels (a bf16 x, K a multiple of 16, a Hopper GPU and a library that has them, no other
    backend forced), else "reference" (the same computation in XLA)."""
    on_kernels = (platform == "cuda" and np.dtype(x_aval.dtype) == np.dtype(jnp.bfloat16)
                  and x_aval.ndim == 2 and x_aval.shape[0] >= 1 and x_aval.shape[1] >= 16
                  and x_aval.shape[1] % 16 == 0 and _config.get().backend in (None, "sm90")
                  and device_for(platform).arch == "sm90"
                  and library.unavailable_reason() is None and library.has_quantize_nvfp4())
    return "sm90" if on_kernels else "reference"


# ---------------------------------------------------------------------------------------------
# sm90


def _padded_k(spec: GemmSpec) -> int:
    return spec.k + (spec.k % 32)  # NVFP4 (block 16) can leave 16 over; TMA needs 16-byte rows


def weights_fit_32bit_indexing(n: int, k: int, kind: str, batch: int) -> bool:
    """Whether the sm90 kernels address a (batch, N, K) weight stack of `kind` (a batch of
    weights, a grouped call's experts, a stack's layers): every kernel reads weights and their
    blocked scales by TMA, whose global address is 64-bit and whose coordinates and strides are
    32-bit: one entry's bytes (the batch stride) and the stack's 128-byte scale rows must fit,
    the stack itself may pass 2 GiB (DeepSeek-V3's 256 experts of gate+up: 3.8 GB)."""
    b_row = k * cat90.KINDS[kind]["bits"] // 8
    scale_rows = 4 * -(-n // 128) * -(-k // (4 * cat90.KINDS[kind]["block"])) * batch
    return max(n * b_row, scale_rows) <= _INT32_MAX


def fits_32bit_indexing(spec: GemmSpec) -> bool:
    """Whether the sm90 kernels' buffers have 32-bit offsets: A's bytes and C's elements over
    the whole batch, the weights per batch entry (weights_fit_32bit_indexing)."""
    m, l = kernel_rows_and_batch(spec)
    k = _padded_k(spec)
    ka, kb = cat90.KIND_OF_FORMAT[spec.fmt_a], cat90.KIND_OF_FORMAT[spec.fmt_b]
    a_row = k * cat90.KINDS[ka]["bits"] // 8
    return (max(m * spec.n * l, m * a_row * l) <= _INT32_MAX
            and weights_fit_32bit_indexing(spec.n, k, kb, l))


def with_dequantized_activation(spec: GemmSpec) -> GemmSpec:
    """The weight-only problem that spec becomes once A is dequantized to bf16."""
    return dataclasses.replace(spec, fmt_a=None, layout_a=None, a_dtype=np.dtype("bfloat16"))


class _Sm90:
    """The sm90 decisions for one problem on one device (each a method, each made once)."""

    def __init__(self, spec: GemmSpec, device: Device, cfg, library):
        self.spec, self.device, self.cfg, self.lib = spec, device, cfg, library
        self.m, self.l = kernel_rows_and_batch(spec)
        self.out = cat90.OUT_OF_DTYPE.get(np.dtype(spec.out_dtype).name)

    def unsupported_reason(self) -> str | None:
        spec = self.spec
        ka, kb = cat90.KIND_OF_FORMAT.get(spec.fmt_a), cat90.KIND_OF_FORMAT.get(spec.fmt_b)
        if (ka, kb) not in cat90.FUSED_PAIRS:
            return f"the sm90 kernel has no {spec.fmt_a or 'plain'} x {spec.fmt_b} variant"
        if spec.fmt_a is None and np.dtype(spec.a_dtype) != np.dtype("bfloat16"):
            return (f"weight-only sm90 needs bf16 activations ({np.dtype(spec.a_dtype).name} is "
                    "not exact in bf16)")
        if self.out is None:
            return f"out dtype {np.dtype(spec.out_dtype).name} not supported"
        if min(spec.m, spec.n, spec.k) < 1 or 0 in spec.batch_shape:
            return "empty problem"
        if not fits_32bit_indexing(spec):
            return "problem too large for the kernel's 32-bit indexing"
        return sm90_unavailable(self.device, self.lib)

    # -- the register-weight variants --------------------------------------------------------
    def register_weights_available(self, spec: GemmSpec) -> bool:
        """Whether a register-weight variant can run this weight-only problem."""
        kb = cat90.KIND_OF_FORMAT[spec.fmt_b]
        return (self.cfg.sm90_register_weights and spec.fmt_a is None
                and spec.k % cat90.K_TILE == 0 and kb in cat90.REGISTER_WEIGHT_KINDS
                and self.lib.has(cat90.fused_variant("bf16_kperm", kb, self.out,
                                                     *cat90.REGISTER_WEIGHT_TILES[0]).name))

    def dequantized_spec_fits(self) -> bool:
        """A quantized activation can be dequantized to bf16 for the weight-only kernels."""
        spec = self.spec
        return (spec.fmt_a is not None and self.cfg.sm90_dequant_a != "0"
                and ("bf16", cat90.KIND_OF_FORMAT[spec.fmt_b]) in cat90.FUSED_PAIRS
                and fits_32bit_indexing(with_dequantized_activation(spec)))

    def register_weights_reachable(self) -> bool:
        """Whether the fused range runs this problem on a register-weight variant (a quantized
        activation dequantized first)."""
        spec = self.spec
        if spec.fmt_a is not None:
            if not self.dequantized_spec_fits():
                return False
            spec = with_dequantized_activation(spec)
        return self.register_weights_available(spec)

    def register_weights_take_decode_rows(self) -> bool:
        """Whether a call in the decode kernel's rows goes to a register-weight variant."""
        min_rows = cat90.register_weight_min_rows(self.spec.n, self.l, self.device.sm_count,
                                                  cat90.KIND_OF_FORMAT.get(self.spec.fmt_b),
                                                  card=self.device.card)
        return self.m >= min_rows and self.register_weights_reachable()

    # -- limits ------------------------------------------------------------------------------
    def max_rows(self) -> int | None:
        """Rows past which dequantize + a bf16 GEMM runs instead of the kernels."""
        if self.cfg.sm90_max_rows is not None:
            return self.cfg.sm90_max_rows or None
        return cat90.fused_max_rows(self.spec.n, self.spec.k, weight_only=self.spec.fmt_a is None,
                                    register_weights=self.register_weights_reachable(),
                                    two_operand=self.cfg.sm90_dequant_a == "0",
                                    b_kind=cat90.KIND_OF_FORMAT.get(self.spec.fmt_b),
                                    card=self.device.card)

    def decode_choice(self, spec: GemmSpec):
        """(DecodeVariant, splits) when the decode kernel runs `spec` (A as given), else None."""
        limit = self.cfg.sm90_decode_max_rows
        if self.m > (cat90.DECODE_MAX_ROWS if limit is None else limit):
            return None
        if self.register_weights_take_decode_rows():
            return None
        choice = cat90.choose_decode_variant(self.m, spec.n, _padded_k(spec), spec.fmt_a,
                                             spec.fmt_b, self.device.sm_count, out=self.out,
                                             splits=self.cfg.sm90_decode_splits)
        if choice is None or not self.lib.has(choice[0].name):
            return None
        return choice

    def dequantizes_activation_first(self) -> bool:
        if not self.dequantized_spec_fits():
            return False
        if self.cfg.sm90_dequant_a == "all" or self.decode_choice(self.spec) is None:
            return True
        # in the decode kernel's rows only a wide mxfp8 activation gains
        return (cat90.KIND_OF_FORMAT[self.spec.fmt_a] == "mxfp8"
                and self.m >= cat90.DECODE_DEQUANT_MXFP8_FROM)

    def uses_dot_alpha(self) -> bool:
        """Past the kernels' rows: the cuBLASLt GEMM with alpha in its epilogue, where XLA's dot
        cannot produce the output itself (an alpha to apply first, or an f32 output), the output
        is bf16 or f32, there are enough outputs (below, cuBLASLt splits K and loses to the f32
        pass), N and K rows are whole 16-byte multiples and the library has the target."""
        spec = self.spec
        if not self.cfg.sm90_dot_alpha or direct_output(spec, np.dtype("bfloat16")):
            return False
        return (gemm_outputs(spec) >= DIRECT_OUTPUT_MIN_OUTPUTS and spec.n % 8 == 0
                and spec.k % 8 == 0 and self.out in ("bf16", "f32") and self.lib.has_dot_alpha())

    def plan(self) -> Plan | str:
        why = self.unsupported_reason()
        if why is not None:
            return why
        spec, m, l, sm = self.spec, self.m, self.l, self.device.sm_count
        common = dict(spec=spec, m=m, l=l, sm_count=sm)
        limit = self.max_rows()
        if limit is not None and m > limit:
            return Plan("sm90", "dot_alpha" if self.uses_dot_alpha() else "xla_dot", **common)
        dequantize_a = self.dequantizes_activation_first()
        kspec = with_dequantized_activation(spec) if dequantize_a else spec
        ka, kb = cat90.KIND_OF_FORMAT[kspec.fmt_a], cat90.KIND_OF_FORMAT[kspec.fmt_b]
        k = _padded_k(kspec)
        decode = self.decode_choice(kspec)
        if decode is not None:
            v, splits = decode
            return Plan("sm90", "decode", variant=v.name, a_kind=ka, b_kind=kb,
                        tile=(8 * v.nt, v.tuning.bn), nt=v.nt, splits=splits,
                        workspace=splits * l * m * spec.n, dequantize_a=dequantize_a,
                        a_scales_plain=kspec.fmt_a is not None and kspec.layout_a == "plain",
                        k=k, **common)
        if self.register_weights_available(kspec):
            tile_m, tile_n = cat90.register_weight_tile(m, spec.n, k, l, sm)
            kernel, ka = "register_weights", "bf16_kperm"
        else:
            tile_m, tile_n = 128, cat90.fused_tile_n(m, spec.n, l, sm)
            kernel = "fused"
        tile_n = self.cfg.sm90_tile_n or tile_n
        splits = 0
        if kernel == "register_weights":
            splits = self.register_weight_splits(k, (tile_m, tile_n))
        # split partials are f32 (the f32-output variant writes them); 0: no split
        variant = cat90.fused_variant(ka, kb, "f32" if splits else self.out, tile_m, tile_n).name
        if not self.lib.has(variant):
            return f"the library has no variant {variant}"
        return Plan("sm90", kernel, variant=variant, a_kind=ka, b_kind=kb, tile=(tile_m, tile_n),
                    splits=splits, workspace=splits * l * m * spec.n,
                    dequantize_a=dequantize_a,
                    permute_k=(kernel == "register_weights"
                               and cat90.register_weights_permute_k(kb)),
                    k=k,
                    **common)

    def register_weight_splits(self, k: int, tile: tuple[int, int]) -> int:
        """K ranges per tile of a register-weight call (0: none; else 2 or more): the
        configuration's, else the catalogue's; none where the workspace would pass 32-bit
        indexing."""
        splits = self.cfg.sm90_register_weight_splits or cat90.register_weight_splits(
            self.m, self.spec.n, k, self.l, tile, self.device.sm_count)
        splits = min(splits, -(-k // cat90.K_TILE))
        if splits < 2 or splits * self.l * self.m * self.spec.n > _INT32_MAX:
            return 0
        return splits


def plan_sm90(spec: GemmSpec, device: Device, *, cfg=None, library=LIBRARY) -> Plan | str:
    """The sm90 Plan for `spec`, or why the sm90 backend cannot run it."""
    return _Sm90(spec, device, cfg or _config.get(), library).plan()


# ---------------------------------------------------------------------------------------------
# sm100


def sm90_unavailable(device: Device, library, variant: str | None = None,
                     what: str = "variant") -> str | None:
    """Why the sm90 kernels cannot run here (None: they can): the device is not compute
    capability 9.0, the library is not loaded, or it lacks `variant` (a `what`, for the
    message; a library built before that kernel existed)."""
    if device.arch != "sm90":
        return device.reason or ("the sm90 kernels need compute capability 9.0, this device is "
                                 f"{device.arch}")
    why = library.unavailable_reason()
    if why is None and variant is not None and not library.has(variant):
        why = f"the library has no {what} {variant} (built before that kernel existed?)"
    return why


def plan_ragged_sm90(spec, device: Device, *, library=LIBRARY):
    """The sm90 RaggedPlan for a `ragged_gemm` problem (a RaggedSpec), or why no grouped kernel
    can run it: the grouped register-weight kernel at prefill sizes (catalog/sm90.py:
    choose_ragged_prefill_variant), else the grouped decode kernel (its operand pairs, K a
    multiple of 32 and of the blocks, 32-bit offsets; the variant, item height and split count
    from choose_ragged_decode_variant)."""

    out = cat90.OUT_OF_DTYPE.get(np.dtype(spec.out_dtype).name)
    if spec.fmt_lhs is None and np.dtype(spec.lhs_dtype) != np.dtype("bfloat16"):
        return (f"weight-only sm90 needs a bf16 activation ({np.dtype(spec.lhs_dtype).name} is "
                "not exact in bf16)")
    if out is None:
        return f"out dtype {np.dtype(spec.out_dtype).name} not supported"
    if min(spec.m, spec.n, spec.k, spec.groups) < 1:
        return "empty problem"
    if spec.k % 32:
        return f"K={spec.k} must be a multiple of 32 for the grouped decode kernel"
    # A shard of a sharded call keeps the unsharded call's variant and splits (RaggedSpec);
    # its own rows and experts make its work table.
    pm, pn, pg = spec.plan_shape or (spec.m, spec.n, spec.groups)
    layer = None
    if spec.group_index:
        # One layer of a stack is a dense problem. Found in place (its slice of the scales'
        # address names it), the layer runs gemm's own plan for it; copied, index mode runs the
        # grouped decode kernel with the dense decode kernel's variant and splits where that is
        # the plan, else with the decode kernel's choice for the layer.
        own = GemmSpec(spec.fmt_lhs, spec.fmt_rhs, spec.layout_lhs, spec.layout_rhs,
                       np.dtype(spec.lhs_dtype), np.dtype(spec.out_dtype), (), (), (), spec.m,
                       spec.n, spec.k, spec.alpha_is_one)
        whole = plan_sm90(dataclasses.replace(own, m=pm, n=pn), device, library=library)
        if isinstance(whole, str):
            return whole
        if whole.kernel not in cat90.LAYER_KERNELS or whole.dequantize_a or whole.k != spec.k:
            return (f"gemm runs M={spec.m} N={spec.n} K={spec.k} on its {whole.kernel} kernel"
                    f"{' (activation dequantized first)' if whole.dequantize_a else ''}"
                    f"{' (K padded)' if whole.k != spec.k else ''}: the layer is sliced and "
                    "that kernel runs it")
        layer = as_shard(whole, own)
        if not library.has_layer_gemm():  # both ways below run through the layer target
            return "the library has no layer target (built before gemm(..., layer=) found layers)"
        if pm > cat90.INDEX_MODE_MAX_ROWS or whole.kernel == "register_weights":
            # No index mode past its rows, nor where the layer's plan is the register-weight
            # kernel: index mode runs the decode kernel, which that plan beat (and for FP4
            # weights it would need the activation in K order as well: one more write of it).
            if spec.alpha_is_one:  # the sliced layer needs nothing else
                return (f"gemm runs M={spec.m} N={spec.n} K={spec.k} on its {whole.kernel} "
                        "kernel with no global scale: the layer is sliced and that kernel runs it")
            # slice mode: XLA's slices of the layer, the layer's alpha read from the stack
            return _layer_slice_plan(spec, layer)
        if whole.kernel == "decode":
            choice = (cat90.DecodeVariant(whole.a_kind, whole.b_kind, out, whole.nt), whole.splits)
        else:
            choice = cat90.choose_decode_variant(pm, pn, spec.k, spec.fmt_lhs, spec.fmt_rhs,
                                                 device.sm_count, out=out)
        if choice is not None:  # the grouped kernel's variant of that tile height (its tuning)
            v = dataclasses.replace(choice[0], grouped=True)
            choice = (v, choice[1], -(-spec.m // (8 * v.nt)))
    else:
        cfg = _config.get()
        mode = cfg.sm90_ragged_kernel
        prefill = None if mode == "decode" else cat90.choose_ragged_prefill_variant(
            pm, pn, spec.k, pg, spec.fmt_lhs, spec.fmt_rhs, device.sm_count, out,
            force=mode == "prefill", tile_m=cfg.sm90_ragged_tile_m, card=device.card)
        if prefill is not None:
            return _ragged_prefill_plan(spec, prefill[0], device, library)
        choice = cat90.choose_ragged_decode_variant(pm, pn, spec.k, pg, spec.fmt_lhs,
                                                    spec.fmt_rhs, device.sm_count, out,
                                                    card=device.card)
        if choice is not None:
            choice = (*choice[:2], cat90.ragged_decode_items(spec.m, spec.groups, choice[0].nt))
    if choice is None:
        return (f"the grouped decode kernel has no {spec.fmt_lhs or 'plain'} x {spec.fmt_rhs} "
                f"variant with K={spec.k}")
    v, splits, items = choice
    ka, kb = v.a_kind, v.b_kind
    a_row = spec.k * cat90.KINDS[ka]["bits"] // 8
    if (max(splits * spec.m * spec.n, spec.m * a_row) > _INT32_MAX
            or not weights_fit_32bit_indexing(spec.n, spec.k, kb, spec.groups)):
        return "problem too large for the kernel's 32-bit indexing"
    name = v.name
    why = sm90_unavailable(device, library, name, "grouped decode variant")
    if why is not None:
        return why
    a_scales_plain = spec.fmt_lhs is not None and spec.layout_lhs == "plain"
    if layer is not None:  # index mode reads the activation's scales as the layer's plan does
        a_scales_plain = layer.a_scales_plain
    # Groups from row 0 (not an expert-parallel shard): the kernel makes its items from the raw
    # sizes, so the call is one kernel (kernels/grouped_work.py). A shard's table, built by XLA,
    # carries its row_start. A shard's buffer past SIZES_MODE_MAX_SHARD_ROWS rows also takes
    # XLA's table: a dispatched expert-parallel shard's receive buffer is sized for the worst
    # routing and mostly holds unrouted rows past its groups, whose zeros the table spreads over
    # many CTAs (the kernel's own items give them all to one CTA per tile of N).
    big_shard = spec.plan_shape is not None and spec.m > cat90.SIZES_MODE_MAX_SHARD_ROWS
    raw_sizes = layer is None and not spec.shifted and not big_shard
    # Tiles per CTA only schedule (each tile's sums are the same whichever CTA runs it), so a
    # shard's come from its own rows, experts and N: the unsharded call's would leave a shard
    # with half the experts half the CTAs it needs to fill the GPU.
    per_cta = 1 if layer is not None else cat90.ragged_decode_tiles_per_cta(
        spec.m, spec.n, spec.k, spec.groups, kb, v.nt, splits, device.sm_count, card=device.card)
    return RaggedPlan("sm90", "ragged_decode", spec, "cuda", variant=name, a_kind=ka, b_kind=kb,
                      nt=v.nt, tile=(8 * v.nt, v.tuning.bn), splits=splits,
                      items=items, a_scales_plain=a_scales_plain, raw_sizes=raw_sizes,
                      tiles_per_cta=per_cta, layer=layer)


def _ragged_prefill_plan(spec, v: cat90.Variant, device: Device, library):
    """The sm90 RaggedPlan of the grouped register-weight kernel (prefill sizes; the catalogue
    chose variant v): the activation dequantized to bf16 first where it is quantized (exact),
    K-permuted for FP4 weights; its own work table of at most tile_m rows per item."""

    if (max(spec.m * spec.n, spec.m * 2 * spec.k) > _INT32_MAX
            or not weights_fit_32bit_indexing(spec.n, spec.k, v.b_kind, spec.groups)):
        return "problem too large for the kernel's 32-bit indexing"
    why = sm90_unavailable(device, library, v.name, "grouped register-weight variant")
    if why is not None:
        return why
    return RaggedPlan("sm90", "ragged_prefill", spec, "cuda", variant=v.name, a_kind=v.a_kind,
                      b_kind=v.b_kind, tile=(v.tile_m, v.tile_n),
                      items=cat90.ragged_items(spec.m, spec.groups, v.tile_m),
                      permute_k=cat90.register_weights_permute_k(v.b_kind))


def _layer_slice_plan(spec, layer: Plan):
    """gemm(..., layer=i) in slice mode (lowering/ragged_sm90.py): the layer target runs
    `layer` on XLA's slices of the layer (in place at a loop counter) with the layer's alpha
    read from the stack of global scales, so no XLA kernel runs per call for it."""

    return RaggedPlan("sm90", "layer_slice", spec, "cuda", variant=layer.variant,
                      a_kind=layer.a_kind, b_kind=layer.b_kind, tile=layer.tile,
                      a_scales_plain=layer.a_scales_plain, layer=layer)


def forced_sm100_tile(value: str) -> tuple[int, int, int, int]:
    """'128x64' or '256x128c2x1' -> (tile_m, tile_n, cluster_m, cluster_n)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:c(\d)x(\d))?", value)
    if not m:
        raise ValueError(f"JAX_BLOCKSCALE_SM100_TILE={value!r}: expected e.g. 128x64 or "
                         "256x256c2x1")
    tm, tn = int(m.group(1)), int(m.group(2))
    return tm, tn, int(m.group(3) or (2 if tm == 256 else 1)), int(m.group(4) or 1)


def sm100_unsupported_reason(spec: GemmSpec, device: Device, library=LIBRARY) -> str | None:
    if spec.fmt_a is None:
        return ("weight-only (plain activation x quantized weight) has no block-scaled MMA "
                "on Blackwell (tcgen05 has no bf16 x fp4/fp8 kind); it runs on `reference`")
    if (spec.fmt_a, spec.fmt_b) not in cat100.PAIRS:
        return f"the sm100 kernels have no {spec.fmt_a} x {spec.fmt_b} variant"
    if np.dtype(spec.out_dtype).name not in cat100.OUT_DTYPES:
        return f"out dtype {np.dtype(spec.out_dtype).name} not supported"
    if min(spec.m, spec.n, spec.k) < 1 or 0 in spec.batch_shape:
        return "empty problem"
    ka = cat100.k_alignment(spec.fmt_a, spec.fmt_b)
    if spec.k % ka:
        return f"K={spec.k} must be a multiple of {ka} for {spec.fmt_a} x {spec.fmt_b}"
    na = 4 if np.dtype(spec.out_dtype) == np.dtype(np.float32) else 8
    if spec.n % na:
        return f"N={spec.n} must be a multiple of {na} for {np.dtype(spec.out_dtype).name} output"
    m, _ = kernel_rows_and_batch(spec)
    if max(m * spec.k, spec.n * spec.k, m * spec.n) > _INT32_MAX:
        return "problem too large for the kernel's 32-bit indexing (M*K, N*K, M*N < 2^31)"
    if device.arch != "sm100":
        return device.reason or ("the sm100 kernels need compute capability 10.0 or 10.3 "
                                 f"(B200/GB200, B300/GB300), this device is {device.arch}")
    return library.sm100_unavailable_reason()


def plan_ragged_sm100(spec, device: Device, *, library=LIBRARY):
    """The sm100 RaggedPlan for a `ragged_gemm` problem (a RaggedSpec): the contiguous grouped
    kernel (catalog/sm100.py: GROUPED_VARIANTS) over the activation padded to whole tiles per
    group (`items` M tiles, a static bound), or why it cannot run it."""

    if spec.fmt_lhs is None:
        return ("weight-only (plain activation x quantized experts) has no block-scaled MMA on "
                "Blackwell; it runs on `reference`")
    if spec.group_index:
        return "one layer of a stack (layer=) runs on the dense sm100 kernel's path, not grouped"
    if min(spec.m, spec.n, spec.k, spec.groups) < 1:
        return "empty problem"
    out = np.dtype(spec.out_dtype).name
    v = cat100.choose_grouped_variant(spec.fmt_lhs, spec.fmt_rhs, out, spec.n, spec.k)
    if v is None:
        return (f"the grouped sm100 kernel takes {cat100.GROUPED_PAIRS} with K and N aligned "
                f"(got {spec.fmt_lhs} x {spec.fmt_rhs} -> {out}, K={spec.k}, N={spec.n})")
    rows = cat100.grouped_padded_rows(spec.m, spec.groups, v.tile_m)
    if max(rows * spec.k, spec.n * spec.k, rows * spec.n) > _INT32_MAX:
        return "problem too large for the kernel's 32-bit indexing"
    if device.arch != "sm100":
        return device.reason or ("the grouped sm100 kernel needs compute capability 10.0 or "
                                 f"10.3, this device is {device.arch}")
    why = library.sm100_unavailable_reason()
    if why is None and not library.has_ragged_sm100():
        why = "the library was built without the grouped sm100 kernels"
    if why is not None:
        return why
    return RaggedPlan("sm100", "grouped", spec, "cuda", variant=v.name,
                      a_kind=spec.fmt_lhs, b_kind=spec.fmt_rhs, tile=(v.tile_m, v.tile_n),
                      items=rows // v.tile_m)


def plan_sm100(spec: GemmSpec, device: Device, *, cfg=None, library=LIBRARY) -> Plan | str:
    """The sm100 Plan for `spec`, or why the sm100 backend cannot run it."""
    why = sm100_unsupported_reason(spec, device, library)
    if why is not None:
        return why
    cfg = cfg or _config.get()
    m, l = kernel_rows_and_batch(spec)
    out = np.dtype(spec.out_dtype).name
    if cfg.sm100_tile:
        tm, tn, cm, cn = forced_sm100_tile(cfg.sm100_tile)
        v = next((v for v in cat100.variants_for(spec.fmt_a, spec.fmt_b, out)
                  if (v.tile_m, v.tile_n, v.cluster_m, v.cluster_n) == (tm, tn, cm, cn)), None)
        if v is None:
            raise ValueError(f"JAX_BLOCKSCALE_SM100_TILE={cfg.sm100_tile}: no compiled variant "
                             f"for {spec.fmt_a} x {spec.fmt_b} -> {out} has that tile")
    else:
        v = cat100.choose_sm100_variant(m, spec.n, spec.k, spec.fmt_a, spec.fmt_b,
                                        device.sm_count, out)
    if v is None:
        return f"no compiled sm100 variant takes K={spec.k}, N={spec.n}"
    return Plan("sm100", "sm100", spec, variant=v.name, tile=(v.tile_m, v.tile_n),
                cluster=(v.cluster_m, v.cluster_n), m=m, l=l, k=spec.k,
                sm_count=device.sm_count)


def plan_summary(p: Plan) -> dict:
    """The plan's decisions as plain values (logs, tests, benchmarks)."""
    keys = ("backend", "kernel", "variant", "tile", "cluster", "nt", "splits", "workspace",
            "dequantize_a", "permute_k", "a_scales_plain", "m", "l", "k")
    return {key: getattr(p, key) for key in keys}

