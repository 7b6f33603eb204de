"""Ties the source never recorded: a Hugging Face-style save stores ``model.embed_tokens.weight``
once, leaves ``lm_head.weight`` out and says ``"tie_word_embeddings": true`` in its config.json.
Ravex reads the tie from the config (or from ``--tie``), writes both names where the target keeps
ties (DCP, torch_save), and with ``--materialize-ties`` writes the head as a tensor of its own, so
a strict ``load_state_dict`` of a safetensors output finds every name.

The files here are written with safetensors' own ``save_file``, the way ``save_pretrained``
lays them out (the real transformers is not a dependency of these tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ravex_convert
from ravex_convert import ConvertOptions
from ravex_convert.errors import LayoutMismatchError, RavexError
from ravex_convert.ties import parse_tie

V, H = 11, 6


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(V, H)
        self.model.norm = torch.nn.LayerNorm(H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def hf_save(path: Path, tie: bool | None = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = TinyLM()
    sd = {k: v.detach().clone() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    path.mkdir()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    if tie is not None:
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tie, "vocab_size": V}))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_the_config_ties_the_head(tmp_path: Path) -> None:
    want = hf_save(tmp_path / "hf")
    c = ravex_convert.read_checkpoint(tmp_path / "hf")
    assert c.aliases == {"model/lm_head.weight": "model/model.embed_tokens.weight"}
    assert any("tie_word_embeddings" in n for n in c.notes)
    # torch_save keeps the tie as torch does (one storage, both names): a strict load works
    ravex_convert.convert(tmp_path / "hf", tmp_path / "out.pt", to="torch_save")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    m = TinyLM()
    m.load_state_dict(sd, strict=True)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())


def test_without_the_config_the_head_is_missing_and_tie_declares_it(tmp_path: Path) -> None:
    hf_save(tmp_path / "hf", tie=None)
    c = ravex_convert.read_checkpoint(tmp_path / "hf")
    assert not c.aliases
    ravex_convert.convert(tmp_path / "hf", tmp_path / "plain.pt", to="torch_save")
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        TinyLM().load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True)["model"], strict=True)
    ravex_convert.convert(tmp_path / "hf", tmp_path / "tied.pt", to="torch_save", options=ConvertOptions(ties={"lm_head.weight": "model.embed_tokens.weight"}))
    TinyLM().load_state_dict(torch.load(tmp_path / "tied.pt", weights_only=True)["model"], strict=True)


def test_materialize_ties_writes_the_head_for_a_strict_safetensors_load(tmp_path: Path) -> None:
    want = hf_save(tmp_path / "hf")
    ravex_convert.convert(tmp_path / "hf", tmp_path / "once.safetensors", to="safetensors")
    assert "lm_head.weight" not in load_file(tmp_path / "once.safetensors")  # stored once, the tie in ravex.aliases
    res = ravex_convert.convert(tmp_path / "hf", tmp_path / "every.safetensors", to="safetensors", options=ConvertOptions(materialize_ties=True))
    assert any("lm_head.weight" in n for n in res["notes"])
    got = load_file(tmp_path / "every.safetensors")
    assert set(got) == set(want) and torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])
    m = TinyLM()
    m.load_state_dict(got, strict=True)


def test_dcp_output_holds_the_head(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    hf_save(tmp_path / "hf")
    ravex_convert.convert(tmp_path / "hf", tmp_path / "dcp", to="dcp")
    meta = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert "model.lm_head.weight" in meta.state_dict_metadata and "model.model.embed_tokens.weight" in meta.state_dict_metadata


def test_two_embeddings_are_not_guessed(tmp_path: Path) -> None:
    hf_save(tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    sd["model.vision.embed_tokens.weight"] = torch.zeros(3, H)
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    c = ravex_convert.read_checkpoint(tmp_path / "hf")
    assert not c.aliases
    assert any("pass --tie lm_head.weight=" in n for n in c.notes), c.notes


def test_bad_ties_are_refused(tmp_path: Path) -> None:
    hf_save(tmp_path / "hf", tie=None)
    with pytest.raises(LayoutMismatchError, match="no tensor 'embed.weight'") as e:
        ravex_convert.convert(tmp_path / "hf", tmp_path / "a.pt", to="torch_save", options=ConvertOptions(ties={"lm_head.weight": "embed.weight"}))
    assert "model.embed_tokens.weight" in (e.value.hint or "")
    with pytest.raises(LayoutMismatchError, match="stores 'model.norm.weight' as a tensor of its own"):
        ravex_convert.convert(tmp_path / "hf", tmp_path / "b.pt", to="torch_save", options=ConvertOptions(ties={"model.norm.weight": "model.embed_tokens.weight"}))
    for bad in ("lm_head.weight", "=x", "a=a"):
        with pytest.raises(RavexError, match="expected ALIAS=TARGET"):
            parse_tie(bad)
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()
