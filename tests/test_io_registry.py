"""ParamRegistry (SPEC T-18): collection by attribute path, frozen entries, views, optimizer
registration, zero_grad, state-dict save/load with aliases."""
import io

import numpy as np
import pytest
import safetensors.numpy as stnp

import fucina as fu
from fucina.io import Alias, ParamRegistry


class Linear:
    def __init__(self, ctx, n_in, n_out, seed, variable=True):
        rng = np.random.default_rng(seed)
        make = ctx.variable if variable else ctx.tensor
        self.weight = make(rng.standard_normal((n_out, n_in)).astype(np.float32), ("out", "in"))
        self.bias = make(rng.standard_normal(n_out).astype(np.float32), ("out",))


class Slotted:
    __slots__ = ("scale", "_hidden", "unset")

    def __init__(self, ctx):
        self.scale = ctx.variable(np.ones(3, np.float32), ("d",), dtype="bf16")
        self._hidden = ctx.variable(np.ones(3, np.float32), ("d",))


class OneSlot(Slotted):
    __slots__ = "extra"  # a single-string __slots__ names one slot


class Model:
    def __init__(self, ctx, seed=0, variable=True):
        self.ctx = ctx
        self.name = "tiny"
        self.n_layers = 2
        self.encoder = Linear(ctx, 4, 3, seed, variable)
        self.layers = [Linear(ctx, 3, 3, seed + 1, variable), Linear(ctx, 3, 3, seed + 2, variable)]
        self.pair = (Linear(ctx, 3, 2, seed + 3, variable),)
        self.experts = {"up": Linear(ctx, 2, 2, seed + 4, variable), 7: Linear(ctx, 2, 1, seed + 5, variable),
                        (1, 2): Linear(ctx, 1, 1, seed + 6, variable)}
        self.norm = ctx.tensor(np.full(3, 0.5, np.float16), ("d",), dtype="f16")  # frozen
        self.positions = ctx.tensor(np.arange(4), ("s",), dtype="i64")            # skipped by collect
        self.mask = ctx.tensor([True, False], ("s",), dtype="bool")                # skipped
        self.slotted = OneSlot(ctx)
        self.slotted.extra = ctx.variable(np.zeros(2, np.float32), ("e",), dtype="f16")
        self.head = self.encoder.weight  # tied: registered once, under the first path
        self.fn = lambda x: x
        self.array = np.zeros(3)
        self._cache = ctx.zeros((3,), ("d",))  # private: not part of the schema
        self.tags = {"a", "b"}


COLLECTED = ["encoder.weight", "encoder.bias", "layers.0.weight", "layers.0.bias",
             "layers.1.weight", "layers.1.bias", "pair.0.weight", "pair.0.bias",
             "experts.up.weight", "experts.up.bias", "experts.7.weight", "experts.7.bias", "norm",
             "slotted.extra", "slotted.scale"]


def test_collect_by_attribute_path(ctx1):
    m = Model(ctx1)
    m.layers.append(m)  # a cycle: visited once
    reg = ParamRegistry()
    reg.collect(m)
    m.layers.pop()  # (break it so the tensors die before the context closes)
    assert reg.names() == COLLECTED
    assert reg.parameter_count() == len(COLLECTED)
    views = [reg.view(i) for i in range(reg.parameter_count())]
    assert [v.trainable for v in views] == [n != "norm" for n in COLLECTED]
    assert views[0].dtype == "f32" and views[0].shape == (3, 4)
    assert views[12].dtype == "f16" and not views[12].trainable
    assert views[13].dtype == "f16" and views[13].trainable  # f16/bf16 variables train
    assert views[14].dtype == "bf16" and views[14].trainable

    reg2 = ParamRegistry()
    reg2.collect_prefixed("model", m)
    assert reg2.names() == ["model." + n for n in COLLECTED]
    reg3 = ParamRegistry()
    reg3.collect([m.encoder, {"w": m.layers[0].weight}])
    assert reg3.names() == ["0.weight", "0.bias", "1.w"]


def test_add_param_frozen_entries_and_errors(ctx1):
    reg = ParamRegistry()
    w = ctx1.variable(np.zeros((2, 3), np.float32), ("a", "b"))
    ids = ctx1.tensor([1, 2], ("s",), dtype="i64")
    reg.add_param("w", w)
    reg.add_param("ids", ids)  # i64: explicit add_param only, always frozen
    reg.add_param("w_again", w)  # the same tensor under a second name is allowed
    assert [reg.view(i).trainable for i in range(3)] == [True, False, True]
    for bad, match in [("", "non-empty"), ("a\0b", "NUL-free"), ("__metadata__", "__metadata__"),
                       ("x\udc80", "lone surrogate"), ("é" * 40000, "at most 65535 UTF-8 bytes, got 80000"),
                       (None, "expected a str name")]:
        with pytest.raises(fu.CheckpointInvalidName, match=match):
            reg.add_param(bad, w)
    reg.add_param("é" * 32767, w)  # 65534 bytes: fine
    with pytest.raises(fu.CheckpointDuplicateName, match="'w' is already registered"):
        reg.add_param("w", ids)
    with pytest.raises(fu.NonContiguousParam, match="param 'v'"):
        reg.add_param("v", w.narrow("b", 0, 2))
    with pytest.raises(fu.DTypeError, match="param 'mask'.*got bool"):
        reg.add_param("mask", ctx1.tensor([True], ("s",), dtype="bool"))
    assert reg.parameter_count() == 4
    with pytest.raises(fu.IndexOutOfBounds, match=r"\[0, 4\), got 4"):
        reg.view(4)
    with pytest.raises(fu.IndexOutOfBounds):
        reg.view(-1)


def test_collect_is_all_or_nothing(ctx1):
    m = Model(ctx1)
    reg = ParamRegistry()
    reg.add_param("layers.1.bias", ctx1.zeros((3,), ("d",)))
    with pytest.raises(fu.CheckpointDuplicateName, match="layers.1.bias"):
        reg.collect(m)
    assert reg.names() == ["layers.1.bias"]
    reg.collect_prefixed("m", m)
    assert reg.parameter_count() == 1 + len(COLLECTED)


def test_view_bytes_alias_storage(ctx1):
    m = Model(ctx1)
    reg = ParamRegistry()
    reg.collect(m)
    v = reg.view(1)  # encoder.bias, a variable
    assert v.name == "encoder.bias" and len(v.bytes_view) == 3 * 4 and not v.bytes_view.readonly
    np.frombuffer(v.bytes_view, np.float32)[:] = [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(m.encoder.bias.numpy(), [1.0, 2.0, 3.0])
    bf = reg.view(14)
    np.testing.assert_array_equal(np.frombuffer(bf.bytes_view, np.uint16),
                                  m.slotted.scale.data_const())


class RecordingOptimizer:
    """A stand-in with the optimizer's registration surface."""

    def __init__(self):
        self.calls = []

    def add_param_named(self, t, name):
        self.calls.append((name, t))


class KeywordOptimizer:
    def __init__(self):
        self.calls = []

    def add_param(self, t, name=None):
        self.calls.append((name, t))


def test_add_params_to(ctx1):
    m = Model(ctx1)
    reg = ParamRegistry()
    reg.collect(m)
    reg.add_param("positions", m.positions)
    trainable = [n for n in COLLECTED if n != "norm"]
    for opt in (RecordingOptimizer(), KeywordOptimizer()):
        reg.add_params_to(opt)
        assert [n for n, _ in opt.calls] == trainable
        assert opt.calls[0][1] is m.encoder.weight and opt.calls[-1][1] is m.slotted.scale
    with pytest.raises(TypeError, match="add_param_named"):
        reg.add_params_to(object())


def test_zero_grad(ctx1):
    m = Model(ctx1)
    reg = ParamRegistry()
    reg.collect(m)
    x = ctx1.tensor(np.ones((2, 4), np.float32), ("batch", "in"))
    h = x.dot(m.encoder.weight, "in") + m.encoder.bias
    h.sum_all().backward()
    assert m.encoder.weight.grad() is not None and m.encoder.bias.grad() is not None
    reg.zero_grad()
    assert m.encoder.weight.grad() is None and m.encoder.bias.grad() is None


def test_save_load_round_trip_and_frozen_twin(ctx1, tmp_path):
    src = Model(ctx1, seed=10)
    reg = ParamRegistry()
    reg.collect(src)
    f = io.BytesIO()
    reg.save_state_dict(f)
    data = f.getvalue()
    assert data == _dict_bytes({n: t for n, t in zip(COLLECTED, _tensors(src))})
    assert sorted(_header_names(data)) == sorted(COLLECTED)
    f32_only = {k: v for k, v in stnp.load(_dict_bytes({n: t for n, t in zip(COLLECTED, _tensors(src))
                                                        if t.dtype != "bf16"})).items()}
    np.testing.assert_array_equal(f32_only["layers.1.weight"], src.layers[1].weight.numpy())

    # a constant (grad-free) twin with other values loads the same file: frozen entries load too
    twin = Model(ctx1, seed=99, variable=False)
    treg = ParamRegistry()
    treg.collect(twin)
    assert [treg.view(i).trainable for i in range(treg.parameter_count())] == \
        [n.startswith("slotted.") for n in COLLECTED]
    treg.load_state_dict(io.BytesIO(data))
    for a, b in zip(_tensors(src), _tensors(twin)):
        np.testing.assert_array_equal(a.data_const(), b.data_const())

    path = tmp_path / fu.io.MODEL_STATE_FILE
    reg.save_state_dict(path)
    assert path.read_bytes() == data


def test_renames_need_aliases(ctx1):
    src = Model(ctx1, seed=1)
    reg = ParamRegistry()
    reg.collect(src)
    f = io.BytesIO()
    reg.save_state_dict(f)

    class Renamed(Model):
        def __init__(self, ctx, seed):
            super().__init__(ctx, seed)
            self.enc = self.__dict__.pop("encoder")
            self.head = self.__dict__.pop("head")  # keep the tied alias after its new owner

    dst = Renamed(ctx1, seed=2)
    dreg = ParamRegistry()
    dreg.collect(dst)
    assert "enc.weight" in dreg.names()
    before = dst.enc.weight.numpy()
    with pytest.raises(fu.CheckpointUnknownName, match="'encoder.bias'"):
        dreg.load_state_dict(io.BytesIO(f.getvalue()))
    np.testing.assert_array_equal(dst.enc.weight.numpy(), before)
    dreg.load_state_dict(io.BytesIO(f.getvalue()),
                         aliases=[Alias("encoder.weight", "enc.weight"), Alias("encoder.bias", "enc.bias")])
    np.testing.assert_array_equal(dst.enc.weight.numpy(), src.encoder.weight.numpy())
    np.testing.assert_array_equal(dst.layers[1].bias.numpy(), src.layers[1].bias.numpy())


def _tensors(m):
    return [m.encoder.weight, m.encoder.bias, m.layers[0].weight, m.layers[0].bias,
            m.layers[1].weight, m.layers[1].bias, m.pair[0].weight, m.pair[0].bias,
            m.experts["up"].weight, m.experts["up"].bias, m.experts[7].weight, m.experts[7].bias,
            m.norm, m.slotted.extra, m.slotted.scale]


def _dict_bytes(d):
    f = io.BytesIO()
    fu.io.save_state_dict(f, d)
    return f.getvalue()


def _header_names(data):
    import json
    import struct
    (n,) = struct.unpack("<Q", data[:8])
    return list(json.loads(data[8:8 + n]))
