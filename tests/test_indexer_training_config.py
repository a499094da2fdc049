"""The [indexer] section and model.add_indexer: model args, which weights train (with and without LoRA), and the
combinations refused with the key named (meta-device builds: no memory, no compute)."""

import pytest

from titan_kimi.config import ConfigError, load_job_config
from titan_kimi.lora import is_adapter_parameter
from titan_kimi.models.kimi_k3 import model_args_for
from titan_kimi.training.setup.build import build_model_from_config, model_args_from_config, tokenizer_from_config


def load(*argv: str):
    return load_job_config(list(argv), environ={})


def trainable(*argv: str) -> tuple[set[str], set[str]]:
    """(trainable names, every name) of the model the config builds."""
    cfg = load(*argv)
    args = model_args_from_config(cfg)
    model = build_model_from_config(cfg, args, tokenizer_from_config(cfg, args))
    names = {n for n, _ in model.named_parameters()}
    return {n for n, p in model.named_parameters() if p.requires_grad}, names


def is_indexer(name: str) -> bool:
    return ".indexer." in name


def test_add_indexer_gives_a_k3_flavor_its_k31_siblings_indexer_and_the_mode_reaches_the_args():
    args = model_args_from_config(load("--model.flavor", "k3_debug", "--model.add_indexer", "true",
                                       "--indexer.mode", "warmup"))
    assert args.replace(index_training="frozen") == model_args_for("k31_debug").replace(max_seq_len=args.max_seq_len)
    assert args.index_training == "warmup"
    assert model_args_from_config(load()).index_training == "frozen"


@pytest.mark.parametrize("argv, match", [
    (["--model.add_indexer", "true"], r"model.add_indexer = true, but 'k31_debug' already has an indexer"),
    (["--model.flavor", "k3_debug", "--indexer.mode", "sparse"],
     r"indexer.mode = 'sparse' trains the indexer, but 'k3_debug' has none; valid: 'frozen', a K3.1 flavor"),
])
def test_model_combinations_without_an_indexer_to_train_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_config(load(*argv))


@pytest.mark.parametrize("argv, match", [
    (["--indexer.warmup_trains", "all", "--indexer.mode", "sparse"], r"indexer.warmup_trains = \"all\".*warm-up only"),
    (["--indexer.mode", "warmup", "--lora.enable", "true"], r"lora.enable = true.*adapters would never train"),
    (["--indexer.mode", "deep"], r"indexer.mode = \"deep\""),
    (["--indexer.kl_weight", "0"], r"indexer.kl_weight = 0"),
])
def test_config_combinations_that_would_do_nothing_are_refused_naming_the_key(argv, match):
    with pytest.raises(ConfigError, match=match):
        load(*argv)


def test_what_trains_in_each_mode():
    frozen, names = trainable()
    indexer = {n for n in names if is_indexer(n)}
    assert indexer and not frozen & indexer
    assert trainable("--indexer.mode", "warmup")[0] == indexer
    assert trainable("--indexer.mode", "warmup", "--indexer.warmup_trains", "all")[0] == frozen | indexer
    assert trainable("--indexer.mode", "sparse")[0] == frozen | indexer


def test_lora_never_adapts_the_indexer_and_leaves_it_frozen_unless_the_mode_trains_it():
    frozen, names = trainable("--lora.enable", "true")
    assert frozen and all(is_adapter_parameter(n) for n in frozen)
    sparse, names = trainable("--lora.enable", "true", "--indexer.mode", "sparse")
    assert {n for n in sparse if is_indexer(n)} == {n for n in names if is_indexer(n) and not is_adapter_parameter(n)}
    assert not any(is_indexer(n) and is_adapter_parameter(n) for n in names)
    assert sparse - {n for n in sparse if is_indexer(n)} == frozen
