"""Held-out loss scored once per document, as an outside evaluator scores it.

Training's validation reads the validation split as packed samples: documents
concatenated ``doc EOD doc EOD ...``, cut into ``seq_length`` windows that straddle
document ends, drawn in the dataset's shuffled order and repeated when more samples are
asked for than one pass holds; its loss is a softmax over the padded vocabulary and
scores the EOD tokens too. An evaluator of a released model (lm-eval's
``loglikelihood_rolling``) scores each document alone instead. This module computes
that number with megatron's own forward:

* every document of the validation split, in order (prefix by prefix of the blend), is
  scored once: each of its tokens is predicted, and nothing else (its trailing EOD is
  not scored, no other document is in its context);
* its first token is predicted from the end-of-document id, the token a document
  follows in training's stream (lm-eval's ``prefix_token_id``; lm-eval's default is the
  tokenizer's BOS, which training never puts before a document);
* rolling windows of the context length ``L`` (the run's ``seq_length``, the
  ``max_position_embeddings`` ``export-hf`` writes, lm-eval's ``max_length``):
  ``[EOD] + doc`` is cut into the inputs ``[0, L)``, ``[L, 2L)``, ..., and the last,
  shorter window is right-aligned, its tokens scored with the ``L`` tokens before them;
* the softmax is over the tokenizer's vocabulary: the padding rows megatron adds
  (``make_vocab_size_divisible_by``) are masked out of the logits, as a Hugging Face
  export has no such rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_lns.analysis.depth import forward_hooks, held_out_loss
from megatron_lns.model.language_model import unwrap
from megatron_lns.training.step import Batch

Window = tuple[list[int], int]  # (tokens: inputs plus the last label, labels scored)


def held_out_documents(prefixes: Sequence[str], split: str, eod: int) -> Iterator[list[int]]:
    """The token ids of every document of the validation split of ``prefixes``, in order,
    each without its trailing end-of-document id (preprocessing appends one)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lns.data.splits import document_range, split_bookends

    bookends = split_bookends(split, [1, 1, 1])[1]
    if bookends is None:
        return
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        begin, end = document_range(len(dataset), bookends)
        for index in range(begin, end):
            ids = [int(t) for t in np.asarray(dataset[index])]
            if ids and ids[-1] == eod:
                ids.pop()
            if ids:
                yield ids


def rolling_windows(ids: Sequence[int], prefix: int, length: int) -> list[Window]:
    """lm-eval's rolling windows over one document (``context_len`` 1): ``(tokens,
    scored)`` with at most ``length + 1`` tokens whose last ``scored`` next-token labels
    are the document's tokens scored in that window; the last window right-aligned."""
    stream = [prefix, *ids]
    windows = []
    for start in range(0, len(ids), length):
        scored = min(length, len(ids) - start)
        end = start + scored + 1
        windows.append((stream[max(0, end - length - 1) : end], scored))
    return windows


@dataclass
class DocumentBatches:
    """This rank's micro-batches of the scored windows, and what they hold overall."""

    batches: list[list[Batch]]
    documents: int
    tokens: int


def document_batches(
    documents: Iterator[list[int]],
    eod: int,
    length: int,
    max_windows: int,
    micro_batch_size: int,
    num_microbatches: int,
    data_parallel_size: int,
    data_parallel_rank: int,
) -> DocumentBatches:
    """Whole documents in order while their windows number at most ``max_windows`` (at
    least one document), as global batches laid out over data-parallel ranks as the
    pretraining sampler lays them out; the last one filled with unscored windows."""
    windows: list[Window] = []
    count = tokens = 0
    for ids in documents:
        more = rolling_windows(ids, eod, length)
        if count and len(windows) + len(more) > max_windows:
            break
        windows += more
        count += 1
        tokens += len(ids)
    per_draw = micro_batch_size * data_parallel_size
    global_size = per_draw * num_microbatches
    windows += [([eod], 0)] * (-len(windows) % global_size)
    batches = []
    for first in range(0, len(windows), global_size):
        micro = []
        for draw in range(num_microbatches):
            start = first + draw * per_draw + data_parallel_rank * micro_batch_size
            micro.append(_micro_batch(windows[start : start + micro_batch_size], length, eod))
        batches.append(micro)
    return DocumentBatches(batches, count, tokens)


def _micro_batch(windows: Sequence[Window], length: int, pad: int) -> Batch:
    """Windows padded to ``length`` inputs after their scored labels (causal attention
    never lets the padding reach them); the loss mask keeps exactly the scored labels."""
    rows: dict[str, list] = {"tokens": [], "labels": [], "loss_mask": []}
    for tokens, scored in windows:
        inputs, labels = tokens[:-1], tokens[1:]
        fill = length - len(inputs)
        rows["tokens"].append(inputs + [pad] * fill)
        rows["labels"].append(labels + [pad] * fill)
        rows["loss_mask"].append([0.0] * (len(labels) - scored) + [1.0] * scored + [0.0] * fill)
    batch = {key: torch.tensor(values) for key, values in rows.items()}
    batch["loss_mask"] = batch["loss_mask"].float()
    batch["position_ids"] = torch.arange(length).expand(len(windows), length).contiguous()
    return batch


@contextlib.contextmanager
def padding_masked(model: Sequence[torch.nn.Module], vocab_size: int) -> Iterator[None]:
    """The logits of megatron's vocabulary padding rows (ids ``>= vocab_size``) set to the
    lowest float while inside: the softmax is over the tokenizer's vocabulary."""
    rank = parallel_state.get_tensor_model_parallel_rank()

    def mask(module, args, output):
        logits, bias = output if isinstance(output, tuple) else (output, None)
        local = logits.shape[-1]
        cut = max(0, vocab_size - rank * local)
        if cut >= local:
            return output
        logits = logits.clone()
        logits[..., cut:] = torch.finfo(logits.dtype).min
        return (logits, bias) if isinstance(output, tuple) else logits

    layers = [getattr(unwrap(chunk), "output_layer", None) for chunk in model]
    with forward_hooks([layer for layer in layers if layer is not None], mask):
        yield


@torch.no_grad()
def document_loss(
    model: Sequence[torch.nn.Module], batches: Sequence[Sequence[Batch]], vocab_size: int
) -> tuple[float, int]:
    """Token-mean loss over the scored tokens of ``batches`` (from
    :func:`document_batches`), the softmax over the first ``vocab_size`` ids; and the
    number of scored tokens. The model is put in eval mode and returned to its mode."""
    modes = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()
    try:
        with padding_masked(model, vocab_size):
            return held_out_loss(model, batches)
    finally:
        for chunk, mode in zip(model, modes, strict=True):
            chunk.train(mode)
