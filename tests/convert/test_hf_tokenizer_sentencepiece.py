"""SentencePiece export: the exported ``tokenizer.json`` gives the training ids.

Small SentencePiece models of the kinds that matter are trained offline on the demo
corpus (tests/factory.py: unigram as T5's, BPE with byte fallback as LLaMA's, each with and without the
dummy prefix, plus user-defined and control pieces); the exported tokenizer, loaded with
``AutoTokenizer``, must encode probe texts and held-out documents exactly as
``SentencePieceProcessor.encode`` (what training used), and decode as it does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factory import SENTENCEPIECE_RECIPES

from megatron_lns.config.schema import TokenizerConfig
from megatron_lns.convert import ConversionError
from megatron_lns.convert.hf_tokenizer import PROBE_TEXTS, check_tokenizer, write_tokenizer
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.tokenizer import SentencePieceTokenizer

HELD_OUT = 300  # the corpus's last documents: the models are trained on its first ones
MODELS = list(SENTENCEPIECE_RECIPES)
HARD_TEXTS = (
    "",
    " ",
    " leading space",
    "trailing space ",
    "a  b   c    d",
    "\n\nline\n\n\nbreaks\n",
    "\t\ttabs\tin\t text",
    " \t \n mixed \n\t ",
    "digits 0 12 345 6789 3.14159 1e-9 1,000,000",
    "unicode: naïve café, Ελληνικά, русский, 日本語, 한국어, עברית",
    "emoji and bytes unseen in training: 😀🤖🧪 \u2603 \U0001f9ec \x7f \u200b",
    "\u2047 is the unknown surface; \u2581 the whitespace mark",
    "▁▁ two marks",
    "<sep>split<sep> a@@b @@@ <ctl> <s></s>",
)


@pytest.fixture(scope="session")
def sp_models(factory) -> dict[str, Path]:
    return {name: factory.sentencepiece(name) for name in MODELS}


def held_out() -> list[str]:
    return demo_documents()[-HELD_OUT:]


def export(model: Path, out: Path, probes: list[str]) -> SentencePieceTokenizer:
    """Write ``model``'s Hugging Face tokenizer into ``out`` as export does; the trainer's."""
    out.mkdir()
    trained = SentencePieceTokenizer(str(model))
    cfg = TokenizerConfig(library="sentencepiece", model=str(model))
    write_tokenizer(cfg, trained, out, probes)
    return trained


def load(out: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tokenizer.model_max_length = 2**62
    return tokenizer


def is_tie(got: list[int], want: list[int]) -> bool:
    """The same pieces in another order: a Viterbi tie SentencePiece breaks in float32."""
    return sorted(got) == sorted(want)


@pytest.mark.parametrize("name", ["llama", "llama_no_prefix", "bpe_nfkc"])
def test_bpe_gives_the_training_ids_everywhere(sp_models, tmp_path, name):
    trained = export(sp_models[name], tmp_path / "hf", [])
    tokenizer = load(tmp_path / "hf")
    texts = [*PROBE_TEXTS, *HARD_TEXTS, *held_out()]
    # Default call: no BOS/EOS is added, as training added none.
    assert tokenizer(texts)["input_ids"] == [trained.encode(text) for text in texts]


@pytest.mark.parametrize("name", ["t5", "t5_no_prefix", "unigram_specials", "unigram_identity"])
def test_unigram_gives_the_training_ids_up_to_float32_ties(sp_models, tmp_path, name):
    """Unigram: exact on the export's probe texts; elsewhere every difference is the
    same pieces in another order (runs such as ``****`` or ``@@@``), and rare."""
    trained = export(sp_models[name], tmp_path / "hf", [])
    tokenizer = load(tmp_path / "hf")
    assert tokenizer(list(PROBE_TEXTS))["input_ids"] == [trained.encode(t) for t in PROBE_TEXTS]
    texts = [*HARD_TEXTS, *held_out()]
    got = tokenizer(texts)["input_ids"]
    want = [trained.encode(text) for text in texts]
    differ = [i for i in range(len(texts)) if got[i] != want[i]]
    assert all(is_tie(got[i], want[i]) for i in differ)
    assert len(differ) <= len(texts) // 20, f"{len(differ)} of {len(texts)} texts differ"


def test_a_unigram_tie_is_exported_with_a_warning_naming_the_text(sp_models, tmp_path):
    """A tie (the same pieces, so the same total score) is said, with the text and how the
    ids differ, and exported; any other difference is refused."""
    trained = SentencePieceTokenizer(str(sp_models["t5_no_prefix"]))
    export(sp_models["t5_no_prefix"], tmp_path / "ok", [])
    tokenizer = load(tmp_path / "ok")
    tie = next(doc for doc in demo_documents() if tokenizer.encode(doc) != trained.encode(doc))
    cfg = TokenizerConfig(library="sentencepiece", model=str(sp_models["t5_no_prefix"]))
    (tmp_path / "hf").mkdir()
    ids = write_tokenizer(cfg, trained, tmp_path / "hf", ["no tie here", tie])
    assert ids.warning is not None and "\n" not in ids.warning
    assert f"1 of {len(PROBE_TEXTS) + 2} probe texts" in ids.warning
    assert repr(tie[:40]) in ids.warning and "where training has" in ids.warning
    assert load(tmp_path / "hf").encode(tie) == tokenizer.encode(tie)
    assert export(sp_models["t5_no_prefix"], tmp_path / "quiet", ["no tie here"])
    assert write_tokenizer(cfg, trained, tmp_path / "quiet", []).warning is None


def test_ids_that_differ_otherwise_are_refused_naming_the_text(sp_models, tmp_path):
    """A tokenizer that gives other pieces (here: the dummy prefix dropped from the
    tokenizer.json) is refused with the text and the pieces on each side."""
    out = tmp_path / "hf"
    trained = export(sp_models["t5"], out, [])
    tokenizer_json = json.loads((out / "tokenizer.json").read_text())
    (metaspace,) = tokenizer_json["pre_tokenizer"]["pretokenizers"]
    metaspace["prepend_scheme"] = "never"
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(ConversionError) as refused:
        check_tokenizer(out, trained, [])
    message = str(refused.value)
    assert "unlike training: from token 0" in message and "where training has" in message
    assert "\n" not in message and "--no-tokenizer" in message


@pytest.mark.parametrize("name", list(MODELS))
def test_special_tokens_and_config(sp_models, tmp_path, name):
    import sentencepiece

    export(sp_models[name], tmp_path / "hf", [])
    tokenizer = load(tmp_path / "hf")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models[name]))
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    assert len(tokenizer) == sp.get_piece_size()
    roles = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    for role, index in roles.items():
        assert getattr(tokenizer, f"{role}_token_id") == (index if index >= 0 else None), role
    assert tokenizer.convert_ids_to_tokens(list(range(sp.get_piece_size()))) == [
        sp.id_to_piece(i) for i in range(sp.get_piece_size())
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_is_sentencepiece_decode(sp_models, tmp_path, name):
    """Decoding gives what SentencePiece's decode gives (the text itself where the
    normalizer kept it, unknown characters as `` ⁇ ``); the end-of-document id is dropped as
    a special token."""
    trained = export(sp_models[name], tmp_path / "hf", [])
    tokenizer = load(tmp_path / "hf")
    sp = trained._sp
    for text in [*PROBE_TEXTS, *HARD_TEXTS, *held_out()[:50]]:
        ids = sp.encode(text)
        assert tokenizer.decode(ids) == sp.decode(ids), text
        if sp.unk_id() not in ids:  # skip_special_tokens drops <unk>, SentencePiece shows it
            with_eod = [*ids, trained.eod]
            assert tokenizer.decode(with_eod, skip_special_tokens=True) == sp.decode(ids)
    if name.startswith("llama"):  # byte fallback, identity normalization: lossless
        for text in [*HARD_TEXTS, *held_out()[:50]]:
            if "\u2581" not in text:  # a literal whitespace mark decodes as a space
                assert tokenizer.decode(sp.encode(text)) == text


def test_unsupported_model_types_are_refused(factory, tmp_path):
    with pytest.raises(ConversionError, match="of type word: only unigram and bpe"):
        export(factory.sentencepiece("word"), tmp_path / "hf", [])


@pytest.mark.parametrize("name", list(MODELS))
def test_leading_whitespace_and_unknown_pieces_decode_as_sentencepiece(sp_models, tmp_path, name):
    """The rules SentencePiece's decode applies at the start of the text, on piece
    sequences encode makes from text that starts with whitespace or a literal ``▁``."""
    trained = export(sp_models[name], tmp_path / "hf", [])
    tokenizer = load(tmp_path / "hf")
    sp = trained._sp
    space = sp.piece_to_id("\u2581")
    word = next(i for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith("\u2581t"))
    unk = sp.unk_id()
    for ids in ([space, word], [space, space, word], [unk, word], [space, unk, word], [word]):
        assert tokenizer.decode(ids) == sp.decode(ids), [sp.id_to_piece(i) for i in ids]
