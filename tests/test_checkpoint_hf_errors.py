"""Every bad-checkpoint case fails with a ValueError naming the key (and file), and loads nothing.

The broken key sits in the last shard, so a loader that copied as it validated would have changed the model.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_checkpoint_hf import M, _localise_experts, build_model, empty_like_model, hf_layout, write_hf
from titan_kimi.checkpoint import HFCheckpoint, hf_config, load_hf_checkpoint
from titan_kimi.checkpoint.model_identity import NOT_IN_HF_CONFIG, args_differences
from titan_kimi.models.kimi_k3 import KimiK3ModelArgs, flavor_names, model_args_for
from titan_kimi.models.kimi_k3.init import cast_model_dtype
from titan_kimi.models.kimi_k3.state_dict_adapter import args_from_hf_config

LAST = "model-00003-of-00003.safetensors"
EXPERT = f"{M}layers.7.block_sparse_moe.experts.5.w2"
ATTN = f"{M}layers.7.self_attn."  # gated MLA
KDA = f"{M}layers.6.self_attn."


@pytest.fixture(scope="module")
def reference():
    return build_model("k3_debug", seed=21)


@pytest.fixture(scope="module")
def good(reference):
    return hf_layout(reference, mxfp4=True)


def _missing_shard(path):
    (path / LAST).unlink()


def _remove(key):
    return lambda t: t.pop(key)


def _set(key, value):
    def apply(t):
        t[key] = value
    return apply


def _bad_padding(t):
    t[KDA + "A_log"] = t[KDA + "A_log"].clone()
    t[KDA + "A_log"][100] = 1.0


def _drop_pair(t):
    t.pop(EXPERT + ".weight_packed"), t.pop(EXPERT + ".weight_scale")


# case: (edit of the tensor dict, edit of the written folder, expected message regex)
CASES = {
    "missing shard file": (
        None, _missing_shard,
        rf"key '{M}layers\.\d+\..*' is mapped to shard file '{LAST}', which does not exist",
    ),
    "missing key": (
        _remove(ATTN + "o_proj.weight"), None,
        rf"key '{ATTN}o_proj\.weight' needed by model key 'layers\.7\.attention\.o_proj\.weight' is missing",
    ),
    "missing expert": (
        _drop_pair, None,
        rf"'{EXPERT}\.weight' \(or its MXFP4 \.weight_packed/\.weight_scale pair\) "
        rf"needed by model key 'layers\.7\.moe\.experts\.w2' is missing",
    ),
    "unexpected text key": (
        _set(ATTN + "bogus.weight", torch.zeros(2)), None,
        rf"unexpected key\(s\) that no tensor of this model configuration maps to: '{ATTN}bogus\.weight' \(in {LAST}\)",
    ),
    "unexpected layer": (
        _set(f"{M}layers.8.input_layernorm.weight", torch.zeros(128)), None,
        rf"unexpected key.*'{M}layers\.8\.input_layernorm\.weight'",
    ),
    "shape mismatch": (
        _set(ATTN + "kv_b_proj.weight", torch.zeros(64, 64, dtype=torch.bfloat16)), None,
        rf"'{ATTN}kv_b_proj\.weight' in {LAST}: shape \[64, 64\] does not match model key "
        rf"'layers\.7\.attention\.kv_b_proj\.weight', expected \[128, 32\]",
    ),
    "unconvertible dtype": (
        _set(KDA + "o_norm.weight", torch.zeros(32, dtype=torch.int32)), None,
        rf"'{KDA}o_norm\.weight' in {LAST}: dtype I32 cannot be converted",
    ),
    "packed without scale": (
        _remove(EXPERT + ".weight_scale"), None,
        rf"'{EXPERT}\.weight_packed' in {LAST}: incomplete MXFP4 pair, '{EXPERT}\.weight_scale' is missing",
    ),
    "scale without packed": (
        _remove(EXPERT + ".weight_packed"), None,
        rf"'{EXPERT}\.weight_scale' in {LAST}: incomplete MXFP4 pair, '{EXPERT}\.weight_packed' is missing",
    ),
    "dense and packed": (
        _set(EXPERT + ".weight", torch.zeros(64, 64, dtype=torch.bfloat16)), None,
        r"holds both .* and its MXFP4 pair",
    ),
    "bad packed shape": (
        _set(EXPERT + ".weight_packed", torch.zeros(64, 16, dtype=torch.uint8)), None,
        r"MXFP4 shapes packed \[64, 16\], scale \[64, 2\] .* expected packed \[64, 32\] and scale \[64, 2\]",
    ),
    "bad scale dtype": (
        _set(EXPERT + ".weight_scale", torch.zeros(64, 2)), None,
        r"MXFP4 pair has dtypes \(U8, F32\)",
    ),
    "bad A_log padding": (
        _bad_padding, None,
        rf"'{KDA}A_log' in {LAST}: the padding beyond the 2 real heads must be zero, but entry 100 is 1\.0",
    ),
    "bad A_log length": (
        _set(KDA + "A_log", torch.zeros(100)), None,
        rf"'{KDA}A_log' in {LAST}: shape \[100\] is invalid .* expected \[128\]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_fails_clearly_and_loads_nothing(tmp_path, reference, good, case):
    edit_tensors, edit_files, message = CASES[case]
    tensors = dict(good)
    if edit_tensors is not None:
        edit_tensors(tensors)
    path = write_hf(tmp_path / "hf", tensors, reference.args)
    if edit_files is not None:
        edit_files(path)
    model = empty_like_model(reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(model, path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_index_pointing_at_a_file_without_the_key(tmp_path, reference, good):
    path = write_hf(tmp_path / "hf", good, reference.args)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][ATTN + "o_proj.weight"] = "model-00001-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    message = rf"'{ATTN}o_proj\.weight' is mapped to 'model-00001-of-00003\.safetensors', but that file does not contain it"
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(empty_like_model(reference), path)


def test_fp32_parameters_need_an_fp32_destination(tmp_path, reference, good):
    path = write_hf(tmp_path / "hf", good, reference.args)
    model = empty_like_model(reference).to(torch.bfloat16)  # casts A_log & co. too
    message = r"model keys 'layers\.0\.attention\.q_conv1d\.weight' \(torch\.bfloat16\), .* and \d+ more must be float32"
    with pytest.raises(ValueError, match=message + ".*cast_model_dtype"):
        load_hf_checkpoint(model, path)


def test_meta_model_and_bad_folders_are_rejected(tmp_path, reference, good):
    path = write_hf(tmp_path / "hf", good, reference.args)
    with torch.device("meta"):
        meta = cast_model_dtype(type(reference)(reference.args), torch.bfloat16)
    with pytest.raises(ValueError, match="meta device; materialise the model"):
        load_hf_checkpoint(meta, path)
    with pytest.raises(ValueError, match="is not a folder"):
        load_hf_checkpoint(reference, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has neither model.safetensors.index.json nor model.safetensors"):
        HFCheckpoint(tmp_path / "empty")


def test_non_strict_loads_what_is_there(tmp_path, reference, good):
    tensors = dict(good)
    tensors.pop(ATTN + "o_proj.weight")
    tensors[ATTN + "bogus.weight"] = torch.zeros(2)
    model = empty_like_model(reference)
    report = load_hf_checkpoint(model, write_hf(tmp_path / "hf", tensors, reference.args), strict=False)
    assert report.missing == ["layers.7.attention.o_proj.weight"]
    assert report.unexpected == [ATTN + "bogus.weight"]
    got, want = model.state_dict(), reference.state_dict()
    assert torch.all(got["layers.7.attention.o_proj.weight"] == 7.0)  # untouched
    assert all(torch.equal(got[k], want[k]) for k in want if k != "layers.7.attention.o_proj.weight")


def test_a_rank_notices_missing_keys_it_does_not_own(tmp_path, reference, good):
    """Expert 5 is missing: a rank holding experts 0..3 fails too, so ranks sharing w2 agree."""
    tensors = dict(good)
    tensors.pop(EXPERT + ".weight_packed"), tensors.pop(EXPERT + ".weight_scale")
    model = empty_like_model(reference)
    _localise_experts(model, 0, 4)
    message = rf"'{EXPERT}\.weight' .* needed by model key 'layers\.7\.moe\.experts\.w2' is missing"
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(model, write_hf(tmp_path / "hf", tensors, reference.args), expert_range=(0, 4))


def test_a_truncated_shard_is_reported_once(tmp_path, reference, good):
    path = write_hf(tmp_path / "hf", good, reference.args)
    data = (path / LAST).read_bytes()
    (path / LAST).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as caught:
        load_hf_checkpoint(empty_like_model(reference), path)
    message = str(caught.value)
    assert message.count(f"cannot read the header of {LAST}") == 1, message
    assert f"({len(data) // 2} bytes; truncated or damaged?)" in message


def test_config_json_that_disagrees_with_the_model_names_every_field(tmp_path, reference, good):
    path = write_hf(tmp_path / "hf", good, reference.args)
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(num_experts_per_token=3, rms_norm_eps=1e-6)
    (path / "config.json").write_text(json.dumps(config))
    model = empty_like_model(reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)config\.json holds a different model than this run builds \(2 fields "
                                         r"differ\).*norm_eps: 1e-06 in the checkpoint, 1e-05 in this model.*"
                                         r"num_experts_per_tok: 3 in the checkpoint, 2 in this model.*hf_config_path"):
        load_hf_checkpoint(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_hf_checkpoint(model, path, check_config=False)  # the caller's explicit choice


@pytest.mark.parametrize("edit, message", [
    (lambda t: t[EXPERT + ".weight_scale"].fill_(255),
     rf"MXFP4 pair \(a scale of 255 decodes to NaN\) '{EXPERT}\.weight_packed' in {LAST} holds 4096 non-finite"),
    (lambda t: t[ATTN + "o_proj.weight"].view(-1)[3].fill_(float("inf")),
     rf"tensor '{ATTN}o_proj\.weight' in {LAST} holds 1 non-finite value\(s\), e\.g\. inf at index \[0, 3\] of the "
     rf"part read for model key 'layers\.7\.attention\.o_proj\.weight'"),
])
def test_non_finite_weights_are_caught_where_they_are_read(tmp_path, reference, good, edit, message):
    tensors = {k: v.clone() for k, v in good.items()}
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(empty_like_model(reference), write_hf(tmp_path / "hf", tensors, reference.args))


@pytest.mark.parametrize("flavor", flavor_names())
def test_our_own_config_json_never_disagrees_with_its_model(flavor):
    args = model_args_for(flavor)
    assert args_differences(args_from_hf_config(hf_config(args)), args, NOT_IN_HF_CONFIG) == []
