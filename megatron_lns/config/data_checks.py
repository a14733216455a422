"""The tokenizer and the data a run reads, checked before any rank starts.

Each rank loads the tokenizer, compares it with each dataset's ``PREFIX.json`` and counts
the documents and tokens every split gets before megatron builds its datasets. On SLURM
that is after the queue: a file that is not a SentencePiece model, data made with another
tokenizer or a corpus too small for its split would wait hours to fail. The same checks
run here, from :func:`~megatron_lns.config.validate.validate`, so ``train --dry-run``,
``submit`` (before sbatch) and ``train`` refuse them at once, naming the key. They read
only headers, descriptions and document lengths, and import neither torch nor
megatron-core: what needs them (a Hugging Face tokenizer loaded whole, the token ids of
data without a description) is still checked by the ranks.
"""

from __future__ import annotations

from megatron_lns.config.loader import ConfigError
from megatron_lns.config.schema import ExperimentConfig
from megatron_lns.data.blend import BUILTIN_PREFIX, DataBlend
from megatron_lns.data.errors import DataError


def dataset_num_samples(cfg: ExperimentConfig) -> tuple[int, int, int]:
    """The (train, valid, test) sample counts a run draws; they decide the datasets'
    index mappings, so whatever rebuilds a run's held-out data must ask for the same."""
    t, m = cfg.trainer, cfg.model
    num_evals = t.max_steps // t.val_check_interval + 1
    return (
        t.max_steps * m.global_batch_size,
        t.limit_val_batches * m.global_batch_size * num_evals,
        0,
    )


def check_tokenizer(cfg: ExperimentConfig) -> int | None:
    """Refuse tokenizer files that do not load; the vocabulary size where it is known
    without loading a Hugging Face tokenizer whole (None for those)."""
    from megatron_lns.data.tokenizer import TOKENIZER_FILE_FIELD, checked_vocab_size

    tok = cfg.model.tokenizer
    key = f"model.tokenizer.{TOKENIZER_FILE_FIELD.get(tok.library, 'library')}"
    try:
        return checked_vocab_size(tok.library, tok.type, tok.model)
    except DataError as err:
        raise ConfigError(f"{key}: {err}") from None


def check_datasets(cfg: ExperimentConfig, blend: DataBlend, vocab_size: int | None) -> None:
    """Refuse token files cut short, data from another tokenizer, and splits megatron
    cannot build samples from (no documents, no tokens, or less than one sample of an
    unweighted blend's prefix).

    Built-in corpora are prepared by the ranks; a file path prefix must exist already
    (``validate`` checked it)."""
    files = [p for p in blend.prefixes if not p.startswith(BUILTIN_PREFIX)]
    if not files:
        return  # without importing numpy
    from megatron_lns.data.index_file import check_token_file
    from megatron_lns.data.metadata import DatasetMetadata
    from megatron_lns.data.splits import check_split_shares, split_bookends
    from megatron_lns.data.tokenizer import tokenizer_name

    d, tok = cfg.model.data, cfg.model.tokenizer
    resolved = tokenizer_name(tok.library, tok.type, tok.model)
    # A path as the config gives it names the same files wherever it is mounted; the
    # login node may resolve its links differently from the compute node that wrote it.
    as_given = tokenizer_name(tok.library, tok.type, tok.model, resolve=False)
    try:
        for prefix in files:
            check_token_file(prefix)
            metadata = DatasetMetadata.load(prefix)
            if metadata is None:  # prepared by other tools: the ranks scan its token ids
                continue
            name = as_given if metadata.tokenizer == as_given else resolved
            mismatch = metadata.tokenizer_mismatch(prefix, name, vocab_size)
            if mismatch:
                raise ConfigError(f"model.data.data_prefix: {mismatch}")
        check_split_shares(
            files,
            d.splits_string,
            split_bookends(d.splits_string, dataset_num_samples(cfg)),
            one_pass_per_prefix=blend.weights is None and len(blend.prefixes) > 1,
            seq_length=d.seq_length,
        )
    except DataError as err:
        raise ConfigError(f"model.data.data_prefix: {err}") from None
