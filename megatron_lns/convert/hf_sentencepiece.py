"""A SentencePiece ``.model`` as a ``tokenizers`` tokenizer that gives SentencePiece's ids.

Training encodes with ``SentencePieceProcessor.encode(text)``: no BOS, no EOS (the
end-of-document id is appended by preprocessing). The export must give the same ids
from ``AutoTokenizer``, which means a ``tokenizer.json``: a ``.model`` declared a Llama
tokenizer is re-interpreted by transformers (its dummy prefix differs), so that is not
enough.

The normalizer / pre-tokenizer / model / decoder chain is transformers' own
``SpmConverter.build_tokenizer_from_spm_proto``, which follows the model's
``normalizer_spec`` (precompiled charsmap, ``remove_extra_whitespaces``,
``add_dummy_prefix``, ``escape_whitespaces``), ranks BPE merges by piece score and keeps
user-defined pieces whole. Its ``legacy`` prefix scheme is the one that matches
SentencePiece: it adds the dummy prefix even when the text starts with whitespace that
the normalizer removed, or with a literal ``▁``. Three things are fixed up here:

* SentencePiece never matches a control, unknown, unused or byte piece in text, but a
  ``tokenizers`` Unigram does (``<s>`` has score 0, the best there is): those pieces get
  a score no path through normal pieces can lose to.
* The decoder is SentencePiece's decode (``sentencepiece_decoder``): the unknown piece
  comes out as ``unk_surface`` (`` ⁇ ``), and leading whitespace is dropped as
  SentencePiece drops it.
* Control and unknown pieces become special tokens (so ``skip_special_tokens`` drops
  them, as SentencePiece's decode does), and text that spells one is still encoded as
  text (``split_special_tokens``), as in training.

What remains different is judged by the export's probe check, not here: Unigram's
Viterbi sums scores in float32 in SentencePiece and in float64 in ``tokenizers``, so on
exact ties (runs such as ``=====`` that several piece orders cover at the same score) the
two may pick different orders of the same pieces; the check exports those with a
warning and refuses any other difference.
"""

from __future__ import annotations

from pathlib import Path

from megatron_lns.convert.errors import ConversionError

# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
MODEL_TYPE_NAMES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# Below any sum of normal piece scores over a span SentencePiece would match.
UNREACHABLE_SCORE = -1e9
WHITESPACE_MARK = "\u2581"  # SentencePiece's "▁", which stands for a space in pieces
ALL_LEADING = 2**31  # as many leading marks as there are


def read_model_proto(model_file: Path):
    """The ``ModelProto`` of a ``.model`` file (sentencepiece ships the protobuf module)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(model_file).read_bytes())
    except Exception as err:  # protobuf's DecodeError, OSError
        raise ConversionError(f"cannot read SentencePiece model {model_file}: {err}") from None
    return proto


def check_supported(proto, model_file: Path) -> None:
    """Refuse the options the converted chain does not implement, naming the option."""
    model_type = proto.trainer_spec.model_type
    if model_type not in (UNIGRAM, BPE):
        name = MODEL_TYPE_NAMES.get(model_type, str(model_type))
        raise ConversionError(
            f"SentencePiece model {model_file} is of type {name}: only unigram and bpe "
            "models can be exported as a Hugging Face tokenizer; export with --no-tokenizer"
        )
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise ConversionError(
            f"SentencePiece model {model_file} sets treat_whitespace_as_suffix, which "
            "Hugging Face tokenizers do not reproduce; export with --no-tokenizer"
        )


def backend_tokenizer(proto):
    """The ``tokenizers.Tokenizer`` that encodes like SentencePiece (see the module doc)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter

    pieces = proto.pieces
    if proto.trainer_spec.model_type == BPE:
        vocab = {piece.piece: index for index, piece in enumerate(pieces)}
    else:
        matched = (NORMAL, USER_DEFINED)
        vocab = [
            (piece.piece, piece.score if piece.type in matched else UNREACHABLE_SCORE)
            for piece in pieces
        ]
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        import transformers

        raise ConversionError(
            f"exporting a SentencePiece tokenizer needs a newer transformers than "
            f"{transformers.__version__} (the one in requirements/constraints.txt); "
            "or export with --no-tokenizer"
        )
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    backend.decoder = sentencepiece_decoder(proto)
    backend.add_special_tokens(
        [
            AddedToken(piece.piece, special=True, normalized=False)
            for piece in pieces
            if piece.type in (UNKNOWN, CONTROL)
        ]
    )
    return backend


def sentencepiece_decoder(proto):
    """SentencePiece's decode as a ``tokenizers`` decoder chain.

    ``SentencePieceProcessor.decode`` drops the leading ``▁`` of the first piece when the
    model adds a dummy prefix, and with ``remove_extra_whitespaces`` drops the leading
    ``▁`` of every piece until some text has come out (``["▁", "▁a"]`` decodes to ``"a"``);
    the unknown piece comes out as ``unk_surface`` (`` ⁇ ``), which is never stripped.
    The converter's decoder strips one space after all pieces are joined, so it differs
    on the second rule and on a leading unknown piece: strip ``▁`` before it becomes a
    space, after the unknown piece has its surface.
    """
    from tokenizers import decoders

    spec, normalizer = proto.trainer_spec, proto.normalizer_spec
    steps = []
    if 0 <= spec.unk_id < len(proto.pieces):
        steps.append(decoders.Replace(proto.pieces[spec.unk_id].piece, spec.unk_surface))
    if spec.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if normalizer.remove_extra_whitespaces:
        steps.append(decoders.Strip(content=WHITESPACE_MARK, left=ALL_LEADING))
    elif normalizer.add_dummy_prefix:
        steps.append(decoders.Strip(content=WHITESPACE_MARK, left=1))
    steps.append(decoders.Replace(WHITESPACE_MARK, " "))
    return decoders.Sequence(steps)


def sentencepiece_tokenizer_fast(model_file: Path):
    """``model_file`` as a ``PreTrainedTokenizerFast`` that adds no BOS/EOS, as training."""
    from transformers import PreTrainedTokenizerFast

    proto = read_model_proto(model_file)
    check_supported(proto, model_file)
    spec = proto.trainer_spec
    roles = {
        f"{role}_token": proto.pieces[index].piece
        for role, index in (
            ("bos", spec.bos_id),
            ("eos", spec.eos_id),
            ("unk", spec.unk_id),
            ("pad", spec.pad_id),
        )
        if 0 <= index < len(proto.pieces)
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer(proto),
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        **roles,
    )
