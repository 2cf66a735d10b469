"""save_params / load_params: bit-exact round trips, metadata checks, clear errors."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blockscale as jbs
from jax_blockscale.interop import params_file as serialization
from jax_blockscale.interop.params_file import (CorruptFileError, ParamsFileError, load_params,
                                          save_params)


def normal(seed, shape, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def heavy(seed, shape):
    """Student-t values (df 2) spanning many binades: exercises many scale and element codes."""
    return np.random.default_rng(seed).standard_t(2, shape).astype(np.float32)


def bits(x):
    x = np.asarray(x)
    return x.dtype.name, x.shape, x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize])


def assert_same_bits(a, b):
    ad, ash, ab = bits(a)
    bd, bsh, bb = bits(b)
    assert (ad, ash) == (bd, bsh)
    np.testing.assert_array_equal(ab, bb)


def assert_same_blockscaled(a, b):
    assert (a.fmt, a.layout) == (b.fmt, b.layout)
    assert_same_bits(a.data, b.data)
    assert_same_bits(a.scales, b.scales)
    assert (a.global_scale is None) == (b.global_scale is None)
    if a.global_scale is not None:
        assert_same_bits(a.global_scale, b.global_scale)


def sample_params():
    """Every format and layout, odd (padded) shapes, nvfp4 with and without the global scale,
    plain arrays in bf16 / f32 / int32, and an int-keyed level as NNX lists produce."""
    p = {}
    for i, fmt in enumerate(jbs.FORMATS):
        shape = (40, 96) if jbs.get_format(fmt).block == 32 else (40, 80)
        p[fmt] = {"kernel": jbs.quantize(heavy(i, shape), fmt, layout="blocked"),
                  "plain": jbs.quantize(heavy(100 + i, (3, 7, shape[1])), fmt),
                  "bias": jnp.asarray(normal(200 + i, (40,)), jnp.bfloat16)}
    p["nvfp4"]["no_global"] = jbs.quantize(heavy(300, (16, 32)), "nvfp4", global_scale=None)
    p["nvfp4"]["stacked"] = jbs.quantize(heavy(302, (3, 16, 32)), "nvfp4",
                                         global_scale="per_matrix", layout="blocked")
    p["layers"] = {0: {"scale": jnp.asarray(normal(301, (5,))),
                       "steps": jnp.arange(3, dtype=jnp.int32)}}
    return p


def test_round_trip_is_bit_exact(tmp_path):
    params = sample_params()
    path = tmp_path / "params.npz"
    save_params(path, params)
    loaded = load_params(path)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for fmt in jbs.FORMATS:
        assert_same_blockscaled(params[fmt]["kernel"], loaded[fmt]["kernel"])
        assert_same_blockscaled(params[fmt]["plain"], loaded[fmt]["plain"])
        assert_same_bits(params[fmt]["bias"], loaded[fmt]["bias"])
    assert loaded["nvfp4"]["no_global"].global_scale is None
    assert_same_blockscaled(params["nvfp4"]["no_global"], loaded["nvfp4"]["no_global"])
    assert loaded["nvfp4"]["stacked"].global_scale.shape == (3,)  # one per matrix
    assert_same_blockscaled(params["nvfp4"]["stacked"], loaded["nvfp4"]["stacked"])
    assert_same_bits(params["layers"][0]["steps"], loaded["layers"][0]["steps"])
    # and the loaded weights compute the same thing
    x = jnp.asarray(normal(5, (4, 96)), jnp.bfloat16)
    np.testing.assert_allclose(  # (GPU kernels may split K with atomics: not bit-stable)
        jbs.gemm(x, loaded["mxfp4"]["kernel"], out_dtype=jnp.float32),
        jbs.gemm(x, params["mxfp4"]["kernel"], out_dtype=jnp.float32), rtol=1e-5, atol=1e-5)


def test_fp4_is_stored_packed(tmp_path):
    q = jbs.quantize(normal(6, (64, 128)), "nvfp4", layout="blocked")
    save_params(tmp_path / "w.npz", {"w": q})
    with np.load(tmp_path / "w.npz") as z:
        data = z["0.data"]
    assert data.dtype == np.uint8 and data.shape == (64, 64)
    np.testing.assert_array_equal(data, np.asarray(q.packed_data()))  # torch/Triton order


def test_load_checks_format_and_expected_tree(tmp_path):
    w = normal(7, (32, 64))
    params = {"fc": {"kernel": jbs.quantize(w, "mxfp8_e4m3", layout="blocked"),
                     "bias": jnp.asarray(normal(8, (32,)))}}
    path = tmp_path / "p.npz"
    save_params(path, params)
    with pytest.raises(ParamsFileError, match="fc/kernel: the file holds mxfp8_e4m3 weights, "
                                              "expected nvfp4"):
        load_params(path, fmt="nvfp4")
    load_params(path, fmt="mxfp8_e4m3", like=params)  # what was saved: accepted
    load_params(path, like=jax.eval_shape(lambda: params))  # abstract expectations work too
    wrong_fmt = {"fc": dict(params["fc"], kernel=jbs.quantize(w, "mxfp4", layout="blocked"))}
    with pytest.raises(ValueError, match="fc/kernel: the file holds BlockScaled mxfp8_e4m3 "
                                         "blocked .*expected BlockScaled mxfp4 blocked"):
        load_params(path, like=wrong_fmt)
    wrong_layout = {"fc": dict(params["fc"], kernel=jbs.quantize(w, "mxfp8_e4m3"))}
    with pytest.raises(ParamsFileError, match="expected BlockScaled mxfp8_e4m3 plain"):
        load_params(path, like=wrong_layout)
    wrong_shape = {"fc": dict(params["fc"], bias=jnp.zeros((16,)))}
    with pytest.raises(ParamsFileError, match=r"fc/bias: the file holds array float32\[32\]"):
        load_params(path, like=wrong_shape)
    missing = {"fc": params["fc"], "head": {"bias": jnp.zeros((3,))}}
    with pytest.raises(ParamsFileError, match="head/bias: missing from the file"):
        load_params(path, like=missing)


META_KEY = "__jax_blockscale_meta__"


def _reseal(arrays, meta):
    """Recompute the digests after an edit, as a writer of such a file would have."""
    for entry in meta.get("entries", []):
        bits = {part: arrays[info["name"]] for part, info in entry.get("arrays", {}).items()
                if info["name"] in arrays}
        if isinstance(entry, dict) and isinstance(entry.get("arrays"), dict):
            entry["sha256"] = serialization._entry_digest(entry, bits)
    meta["sha256"] = serialization._meta_digest(meta)


def _rewrite(path, edit, reseal=True):
    """Load the raw npz, let `edit(arrays, meta)` change it, write it back (with digests that
    match the edit unless reseal=False: then the edit is a tamper the digests must catch)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays[META_KEY].tobytes().decode())
    edit(arrays, meta)
    if reseal:
        _reseal(arrays, meta)
    arrays[META_KEY] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)


def test_load_rejects_inconsistent_files(tmp_path):
    path = tmp_path / "p.npz"
    q = jbs.quantize(normal(9, (48, 64)), "mxfp4", layout="blocked")

    def claim(field, value):
        save_params(path, {"w": q})
        _rewrite(path, lambda arrays, meta: meta["entries"][0].__setitem__(field, value))

    claim("fmt", "nvfp4")  # the arrays are mxfp4-shaped: block 32 scales, e8m0
    with pytest.raises(ParamsFileError, match="nvfp4"):
        load_params(path)
    claim("layout", "plain")
    with pytest.raises(ParamsFileError, match="plain scales have shape"):
        load_params(path)
    claim("fmt", "fp5")
    with pytest.raises(ParamsFileError, match="unknown block-scaled format"):
        load_params(path)
    save_params(path, {"w": q})
    _rewrite(path, lambda arrays, meta: arrays.__setitem__("0.data", arrays["0.data"][:-1]))
    with pytest.raises(ParamsFileError, match="metadata says"):
        load_params(path)
    np.savez(tmp_path / "other.npz", w=np.ones(3))
    with pytest.raises(ParamsFileError, match="not a jax_blockscale params file"):
        load_params(tmp_path / "other.npz")


def test_fp6_codes_are_checked(tmp_path):
    path = tmp_path / "p.npz"
    save_params(path, {"w": jbs.quantize(normal(10, (8, 32)), "mxfp6_e2m3")})
    _rewrite(path, lambda arrays, meta: arrays["0.data"].__setitem__((0, 0), 200))
    with pytest.raises(ParamsFileError, match="FP6 codes must be below 64"):
        load_params(path)


def test_save_rejects_other_containers(tmp_path):
    with pytest.raises(TypeError, match="nested dicts"):
        save_params(tmp_path / "p.npz", {"layers": [jnp.ones(3)]})


def test_nnx_model_saves_and_loads(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    from jax_blockscale import nn as jnn

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(64, 32, rngs=rngs)
            self.fc2 = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    model = Net(nnx.Rngs(0))
    qparams = jnn.quantize_params(nnx.state(model, nnx.Param), "nvfp4")
    save_params(tmp_path / "net.npz", qparams)
    served = jnn.quantize_model(nnx.clone(model), "nvfp4", act_fmt="nvfp4")
    skeleton = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    expected = jax.eval_shape(lambda p: jnn.quantize_params(p, "nvfp4"),
                              nnx.state(skeleton, nnx.Param))
    loaded = load_params(tmp_path / "net.npz", fmt="nvfp4", like=expected)
    with pytest.raises(ParamsFileError, match="fc1/kernel: the file holds BlockScaled nvfp4"):
        load_params(tmp_path / "net.npz", like=jax.eval_shape(
            lambda p: jnn.quantize_params(p, "mxfp4"), nnx.state(skeleton, nnx.Param)))
    restored = jnn.from_quantized_params(skeleton, loaded, act_fmt="nvfp4")
    x = jnp.asarray(normal(11, (4, 64)))
    np.testing.assert_allclose(restored(x), served(x), rtol=1e-5, atol=1e-5)


def test_orbax_recipe_detects_a_wrong_target(tmp_path):
    """docs/serving.md: Orbax restores into any target (casting); the saved description of the
    params catches a wrong one."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from jax_blockscale.interop.params_file import check_description, describe_params

    x = normal(12, (32, 64))
    qparams = {"fc": {"kernel": jbs.quantize(x, "mxfp8_e4m3", layout="blocked"),
                      "bias": jnp.asarray(normal(13, (32,)), jnp.bfloat16)}}
    description = json.loads(json.dumps(describe_params(qparams)))  # as stored beside it
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", qparams)
    ckpt.wait_until_finished()
    right = ckpt.restore(tmp_path / "ckpt", jax.eval_shape(lambda: qparams))
    check_description(right, description)
    assert_same_blockscaled(right["fc"]["kernel"], qparams["fc"]["kernel"])
    wrong_target = {"fc": dict(qparams["fc"], kernel=jbs.quantize(x, "mxfp8_e5m2",
                                                                    layout="blocked"))}
    wrong = ckpt.restore(tmp_path / "ckpt", jax.eval_shape(lambda: wrong_target))
    assert wrong["fc"]["kernel"].fmt == "mxfp8_e5m2"  # Orbax cast it without a word
    with pytest.raises(ParamsFileError, match="fc/kernel: the params hold BlockScaled mxfp8_e5m2"):
        check_description(wrong, description)


# ---------------------------------------------------------------------------------------------
# Damaged and edited files: the package's own error, naming the entry; never a wrong value


def _small_params():
    return {"fc": {"kernel": jbs.quantize(heavy(20, (16, 64)), "nvfp4", layout="blocked"),
                   "bias": jnp.asarray(normal(21, (16,)), jnp.bfloat16)},
            "fp6": jbs.quantize(heavy(22, (8, 64)), "mxfp6_e2m3"),
            "stack": jbs.quantize(heavy(23, (2, 8, 32)), "nvfp4", global_scale="per_matrix")}


def test_fp6_format_swap_is_detected(tmp_path):
    """e2m3 and e3m2 share storage and shapes: only the digest tells a relabelled entry."""
    path = tmp_path / "p.npz"
    for fmt, other in (("mxfp6_e2m3", "mxfp6_e3m2"), ("mxfp6_e3m2", "mxfp6_e2m3")):
        save_params(path, {"w": jbs.quantize(heavy(24, (8, 64)), fmt)})
        _rewrite(path, lambda arrays, meta: meta["entries"][0].__setitem__("fmt", other),
                 reseal=False)
        with pytest.raises(CorruptFileError, match="^w: its metadata or bits do not match"):
            load_params(path)


def test_tampered_bits_are_detected(tmp_path):
    path = tmp_path / "p.npz"
    save_params(path, _small_params())

    def flip(arrays, meta):
        entry = next(e for e in meta["entries"] if e["path"] == ["fc", "kernel"])
        name = entry["arrays"]["scales"]["name"]
        arrays[name] = arrays[name].copy()
        arrays[name].reshape(-1)[3] ^= 1  # one scale one code off: a valid file otherwise

    _rewrite(path, flip, reseal=False)
    with pytest.raises(CorruptFileError, match="^fc/kernel: .*SHA-256"):
        load_params(path)
    load_params(path, verify=False)  # the check can be skipped (the rest still holds)


def test_edited_metadata_is_detected(tmp_path):
    path = tmp_path / "p.npz"
    save_params(path, _small_params())
    _rewrite(path, lambda arrays, meta: meta["entries"].pop(), reseal=False)  # an entry dropped
    with pytest.raises(CorruptFileError, match="metadata does not match its SHA-256"):
        load_params(path)


@pytest.mark.parametrize("edit,match", [
    (lambda arrays, meta: meta["entries"][0].pop("fmt"), "fc/kernel: the metadata lacks fmt"),
    (lambda arrays, meta: meta.pop("entries"), "no list of entries"),
    (lambda arrays, meta: meta["entries"][0].pop("path"), "entry 0: the metadata lacks path"),
    (lambda arrays, meta: meta["entries"][0]["arrays"]["data"].pop("shape"),
     r"fc/kernel \(data\): the metadata lacks"),
    (lambda arrays, meta: meta["entries"][0].__setitem__("kind", "tensor"),
     "fc/kernel: unknown entry kind 'tensor'"),
    (lambda arrays, meta: arrays.pop(meta["entries"][0]["arrays"]["scales"]["name"]),
     r"fc/kernel \(scales\): array '0.scales' missing"),
])
def test_malformed_metadata_raises_the_package_error(tmp_path, edit, match):
    path = tmp_path / "p.npz"
    save_params(path, _small_params())
    _rewrite(path, edit)
    with pytest.raises(CorruptFileError, match=match):
        load_params(path)


@pytest.mark.parametrize("raw,match", [
    (b"{not json", "not UTF-8 JSON"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[1, 2]", "not a JSON object"),
])
def test_unreadable_metadata(tmp_path, raw, match):
    path = tmp_path / "p.npz"
    np.savez(path, **{META_KEY: np.frombuffer(raw, np.uint8), "0.data": np.ones(3, np.uint8)})
    with pytest.raises(CorruptFileError, match=match):
        load_params(path)


def test_empty_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "p.npz"
    save_params(path, _small_params())
    raw = path.read_bytes()
    for n in (0, 10, len(raw) // 2, len(raw) - 1):
        (tmp_path / "t.npz").write_bytes(raw[:n])
        with pytest.raises(CorruptFileError, match="t.npz"):
            load_params(tmp_path / "t.npz")
    np.save(tmp_path / "one.npy", np.ones(3))
    with pytest.raises(ParamsFileError, match="single .npy array"):
        load_params(tmp_path / "one.npy")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(CorruptFileError):
        load_params(tmp_path / "text.npz")
    with pytest.raises(FileNotFoundError):
        load_params(tmp_path / "absent.npz")


def test_version_1_files_still_load(tmp_path):
    path = tmp_path / "p.npz"
    params = _small_params()
    save_params(path, params)

    def as_v1(arrays, meta):
        meta["version"] = 1
        del meta["sha256"]
        for e in meta["entries"]:
            del e["sha256"]

    _rewrite(path, as_v1, reseal=False)
    loaded = load_params(path)
    assert_same_blockscaled(loaded["fc"]["kernel"], params["fc"]["kernel"])
    assert_same_blockscaled(loaded["stack"], params["stack"])


def _assert_same_tree(a, b):
    la, ta = jax.tree.flatten(a, is_leaf=lambda x: isinstance(x, jbs.BlockScaled))
    lb, tb = jax.tree.flatten(b, is_leaf=lambda x: isinstance(x, jbs.BlockScaled))
    assert ta == tb
    for x, y in zip(la, lb):
        if isinstance(x, jbs.BlockScaled):
            assert_same_blockscaled(x, y)
        else:
            assert_same_bits(x, y)


def test_fuzz_byte_flips_and_truncations(tmp_path):
    """Every damaged copy either raises ParamsFileError (CorruptFileError) or, where the byte
    was one nobody reads (zip timestamps, .npy header padding), loads bit for bit."""
    path = tmp_path / "p.npz"
    params = _small_params()
    save_params(path, params)
    raw = path.read_bytes()
    want = load_params(path, as_numpy=True)
    _assert_same_tree(want, params)
    rng = np.random.default_rng()
    positions = rng.choice(len(raw), size=min(len(raw), 300), replace=False)
    outcomes = {"error": 0, "same": 0}
    bad = tmp_path / "bad.npz"
    for pos in positions:
        damaged = bytearray(raw)
        damaged[pos] ^= int(rng.integers(1, 256))
        bad.write_bytes(bytes(damaged))
        try:
            got = load_params(bad, as_numpy=True)
        except ParamsFileError:
            outcomes["error"] += 1
            continue
        _assert_same_tree(got, want)  # it loaded: then it must be exactly what was saved
        outcomes["same"] += 1
    for n in rng.choice(len(raw), size=40, replace=False):
        bad.write_bytes(raw[:n])
        with pytest.raises(ParamsFileError):
            load_params(bad, as_numpy=True)
    assert outcomes["error"] > len(positions) // 2, outcomes
