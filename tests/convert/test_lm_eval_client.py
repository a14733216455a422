"""lm-eval-harness as a client of an export: it runs offline on tasks read from local files,
and its loss is the project's own held-out loss on the same token ids.

Two runs: the byte tokenizer (ids 0-255 are UTF-8 bytes, 256 is the end-of-document id,
no BOS), and a T5-style SentencePiece Unigram model, the paper's recipes' kind (its
``</s>`` ends documents; it has a ``<s>`` that training never uses). How the two losses
line up:

- **Boundaries, BOS/EOS.** megatron's GPTDataset trains on documents concatenated as
  ``doc EOD doc EOD ...``, so every document but the first of the stream is read after an
  EOD. lm-eval's ``loglikelihood_rolling`` scores each document alone, starting from its
  prefix token: the tokenizer's BOS, else its EOS, unless ``prefix_token_id`` names it;
  the test (and docs/conversion.md) passes the EOD. So lm-eval scores every token of
  ``doc`` given ``EOD doc[:i]``, and never scores the EOD after the document.
- **Windows.** lm-eval's ``max_length`` is ``config.json``'s ``max_position_embeddings``,
  which export sets to the run's ``seq_length`` ``L``. Its rolling windows (context_len 1)
  cut ``[EOD] + doc`` into the inputs ``[0, L)``, ``[L, 2L)``, ... as megatron's samples
  cut its stream, except the last, shorter one, which lm-eval right-aligns: its ``p``
  tokens are scored with the ``L`` tokens before them as context.
- **Vocabulary padding.** megatron pads the vocabulary (257 -> 384) and its loss takes the
  softmax over all 384 logits; export trims the padding rows, so the exported model's
  softmax is over 257. Its loss is lower by ``logsumexp(z[:384]) - logsumexp(z[:257])``
  per token, which is computed here from the megatron logits and subtracted.

The project's side is ``held_out_loss`` (the validation forward: megatron's schedules,
the model's own cross-entropy) on batches holding exactly lm-eval's windows, with a loss
mask on the tokens lm-eval scores. Both sides are fp32 on the CPU and compute the same
function in a different order (megatron's fused QKV, its attention and cross-entropy vs
transformers' separate projections, SDPA and ``log_softmax``): each logit differs by a
few fp32 roundings (~1e-7 relative; the parity tests bound it by 1e-5 for any model),
and the mean over all scored tokens averages them (observed: 2e-8 to 9e-8 relative).
The test asks for 1e-6: ten times what is observed, and tight enough to see the
smallest accounting mistake, cutting the last window where megatron would instead of
right-aligning it (1.1e-5 relative here). Each negative control (that one, the padding
term, the packed-stream loss) must miss lm-eval's loss by 5 tolerances or more.

Offline: the HF_*_OFFLINE switches are set, and the socket layer is replaced so that any
connection attempt fails and is recorded (the switches alone may have been read at
import time by an earlier test); the test requires that none was made.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import fresh_launch_env
from hf_parity import SEQ, run_config, save_checkpoint, silent

from megatron_lns.analysis.depth import held_out_loss
from megatron_lns.convert import export_hf
from megatron_lns.data.demo_corpus import demo_documents
from megatron_lns.data.splits import document_range
from megatron_lns.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, Tokenizer
from megatron_lns.model.language_model import build_model
from megatron_lns.training.build import model_config
from megatron_lns.training.checkpoint import load_model_weights

RELATIVE_TOLERANCE = 1e-6
# A negative control must miss lm-eval's loss by more than this many tolerances.
CONTROL_MARGIN = 5
TRAIN_STEPS = 10

# A multiple-choice task small enough for the tiny model's 16-token context.
CHOICE_ITEMS = [
    {"question": "def f(x):", "choices": ["return", "import", "zzz"], "answer": 0},
    {"question": "The class", "choices": ["object", "qqqqq", "name"], "answer": 0},
    {"question": "if x", "choices": ["is None", "== 0:", "xq!"], "answer": 1},
    {"question": "import", "choices": ["os", "the", "$$"], "answer": 0},
]


@pytest.fixture()
def no_network(monkeypatch):
    """The offline switches lm-eval, datasets and transformers read, and a socket layer
    that refuses (and records) every connection, so a download cannot happen silently."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield attempts


def held_out_documents(cfg) -> list[str]:
    """A few documents of the validation split of the run's corpus (the demo corpus,
    split ``splits_string`` by documents as megatron splits it)."""
    first, last = validation_document_range(cfg)
    return [doc for doc in demo_documents()[first:last] if len(doc.encode()) <= 200][:8]


def validation_document_range(cfg) -> tuple[int, int]:
    """The demo corpus's documents ``[first, last)`` in the validation split."""
    weights = [float(w) for w in cfg.model.data.splits_string.split(",")]
    begin = sum(weights[:1]) / sum(weights)
    end = sum(weights[:2]) / sum(weights)
    return document_range(len(demo_documents()), (begin, end))


def analyze_export(hf_dir: Path, config: Path, out: Path) -> dict:
    """``megatron-lns analyze`` of the export with the run's config (a process of its own:
    this one holds a world of one); its report entry."""
    command = [
        sys.executable, "-m", "megatron_lns.cli", "analyze", str(hf_dir), "--config",
        str(config), "--no-prune", "--batches", "2", "--out", str(out),
        "model.global_batch_size=32", "model.micro_batch_size=32",
    ]  # fmt: skip
    done = subprocess.run(command, env=fresh_launch_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "analysis.json").read_text())["inputs"][0]


def train_tiny_run(root: Path, cfg, tokenizer: Tokenizer) -> Path:
    """A few dozen AdamW steps of the tiny LNS model on the demo corpus's training
    documents, packed ``doc EOD doc EOD ...`` into ``SEQ + 1``-token samples as GPTDataset
    packs them, saved as training saves a checkpoint."""
    chunks = build_model(model_config(cfg, tokenizer.vocab_size))
    model = chunks[0]
    documents = demo_documents()
    stream = [t for doc in documents[:800] for t in [*tokenizer.encode(doc), tokenizer.eod]]
    samples = torch.tensor(stream[: (len(stream) - 1) // SEQ * SEQ + 1])
    starts = torch.arange(0, samples.numel() - SEQ - 1, SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ).expand(16, SEQ)
    model.train()
    for _ in range(TRAIN_STEPS):
        picked = starts[torch.randint(len(starts), (16,), generator=generator)]
        batch = torch.stack([samples[s : s + SEQ + 1] for s in picked])
        loss = model(batch[:, :-1], positions, None, labels=batch[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return save_checkpoint(chunks, root, cfg, TRAIN_STEPS)


def rolling_windows(
    ids: list[int], prefix: int, length: int, right_align_last: bool = True
) -> list[tuple[list[int], int]]:
    """lm-eval's windows over one document, as megatron samples: ``(tokens, scored)``,
    ``length + 1`` tokens (or fewer, for a short document) whose last ``scored`` next-token
    labels are the tokens lm-eval scores in that window. ``right_align_last=False`` cuts
    the last window where megatron would (a negative control)."""
    stream = [prefix, *ids]
    windows = []
    for start in range(0, len(ids), length):
        scored = min(length, len(ids) - start)
        end = start + scored + 1
        first = max(0, end - length - 1) if right_align_last else start
        windows.append((stream[first:end], scored))
    return windows


def megatron_batch(windows: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """The windows as one megatron micro-batch, each padded to ``SEQ`` inputs; the loss
    mask keeps exactly the scored labels (padding sits after them, so causal attention
    never sees it)."""
    rows = {"tokens": [], "labels": [], "loss_mask": []}
    for tokens, scored in windows:
        inputs, labels = tokens[:-1], tokens[1:]
        pad = SEQ - len(inputs)
        rows["tokens"].append(inputs + [pad_id] * pad)
        rows["labels"].append(labels + [pad_id] * pad)
        rows["loss_mask"].append([0.0] * (len(labels) - scored) + [1.0] * scored + [0.0] * pad)
    batch = {name: torch.tensor(values) for name, values in rows.items()}
    batch["position_ids"] = torch.arange(SEQ).expand(len(windows), SEQ)
    return batch


@torch.no_grad()
def vocabulary_padding_term(model, batch: dict[str, torch.Tensor], vocab: int) -> float:
    """Mean over the scored tokens of ``logsumexp(padded logits) - logsumexp(real logits)``:
    how much the padded rows raise the megatron loss above the trimmed export's."""
    logits = model(batch["tokens"], batch["position_ids"], None).float()
    extra = torch.logsumexp(logits, -1) - torch.logsumexp(logits[..., :vocab], -1)
    return float((extra * batch["loss_mask"]).sum() / batch["loss_mask"].sum())


def write_tasks(directory: Path, documents: list[str], analyzed: list[str]) -> None:
    """The tasks as lm-eval reads them from ``--include_path``: local JSON files
    (``analyzed``: the documents ``analyze`` scored once each)."""
    directory.mkdir()
    perplexity = ["word_perplexity", "byte_perplexity", "bits_per_byte"]
    for name, texts in (("heldout", documents), ("analyzed", analyzed)):
        with (directory / f"{name}.jsonl").open("w") as f:
            for doc in texts:
                f.write(json.dumps({"text": doc}) + "\n")
        write_task(
            directory,
            f"lns_{name}",
            f"{name}.jsonl",
            output_type="loglikelihood_rolling",
            doc_to_text="",
            doc_to_target="{{text}}",
            metric_list=[{"metric": metric} for metric in perplexity],
        )
    (directory / "choices.json").write_text(json.dumps(CHOICE_ITEMS))
    write_task(
        directory,
        "lns_choices",
        "choices.json",
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metric_list=[{"metric": "acc"}],
    )


def write_task(directory: Path, name: str, data_file: str, **fields) -> None:
    """A task YAML (JSON is YAML) reading its test split from a local file."""
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(directory / data_file)},
            "cache_dir": str(directory / "datasets-cache"),
        },
        "test_split": "test",
        **fields,
    }
    (directory / f"{name}.yaml").write_text(json.dumps(task, indent=2) + "\n")


def run_lm_eval(
    hf_dir: Path,
    tasks_dir: Path,
    prefix_token_id: int | None,
    tasks: tuple[str, ...] = ("lns_heldout", "lns_choices", "lns_analyzed"),
) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # The prefix is the end-of-document id, as in training's stream (lm-eval would take a
    # tokenizer's BOS first, which training never saw); None: lm-eval's default.
    prefix = "" if prefix_token_id is None else f",prefix_token_id={prefix_token_id}"
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32{prefix}",
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        device="cpu",
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )


@torch.no_grad()
def transformers_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log-probabilities of ``continuation``'s tokens after ``context``, straight
    from ``AutoModelForCausalLM`` (lm-eval's delimiter: one space)."""
    context_ids = tokenizer(context)["input_ids"]
    ids = tokenizer(context + " " + continuation)["input_ids"]
    logits = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)
    return sum(float(logits[i - 1, ids[i]]) for i in range(len(context_ids), len(ids)))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("library", ["byte", "sentencepiece"])
def test_lm_eval_loss_on_an_export_is_the_projects_held_out_loss(
    seeded, tmp_path, no_network, private_corpus_cache, factory, library
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if library == "byte":
        trained: Tokenizer = ByteTokenizer()
        cfg = run_config()  # LNS (the default), RMSNorm, GQA, untied, vocab 257 padded to 384
    else:
        # A T5-style SentencePiece Unigram model (the paper's recipes' kind), trained on
        # the demo corpus's first documents; it has a BOS (``<s>``) that training never uses.
        model_file = str(factory.sentencepiece("t5"))
        trained = SentencePieceTokenizer(model_file)
        cfg = run_config(tokenizer={"library": "sentencepiece", "model": model_file})
    vocab, eod = trained.vocab_size, trained.eod
    checkpoint = train_tiny_run(tmp_path / "run", cfg, trained)
    hf_dir = export_hf(tmp_path / "run", tmp_path / "hf", progress=silent)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf_model.config.max_position_embeddings == SEQ
    assert tokenizer.eos_token_id == eod
    assert tokenizer.bos_token_id == (None if library == "byte" else 1)

    documents = held_out_documents(cfg)
    ids = [tokenizer(doc)["input_ids"] for doc in documents]
    assert ids == [trained.encode(doc) for doc in documents]
    lengths = [len(i) for i in ids]
    # Cover a document within one window and a right-aligned last window.
    assert min(lengths) < SEQ and any(n > SEQ and n % SEQ for n in lengths), lengths
    analyzed = analyze_export(hf_dir, checkpoint / "config.yaml", tmp_path / "analysis")
    first, _ = validation_document_range(cfg)
    analyzed_documents = demo_documents()[first : first + analyzed["documents"]]
    write_tasks(tmp_path / "tasks", documents, analyzed_documents)
    results = run_lm_eval(hf_dir, tmp_path / "tasks", prefix_token_id=eod)

    # (c) analyze's once-per-document loss of the export is lm-eval's on the documents it
    # scored (the first ones of the validation split), with the EOD as lm-eval's prefix.
    scored = [-s["resps"][0][0] for s in results["samples"]["lns_analyzed"]]
    analyzed_ids = [trained.encode(doc) for doc in analyzed_documents]
    assert sum(map(len, analyzed_ids)) == analyzed["document_tokens"]
    lm_eval_analyzed = sum(scored) / analyzed["document_tokens"]
    print(
        f"analyze once-per-document loss {analyzed['document_loss']:.7f} "
        f"({analyzed['documents']} documents), lm-eval {lm_eval_analyzed:.7f}, difference "
        f"{analyzed['document_loss'] - lm_eval_analyzed:.2e}; validation-style loss "
        f"{analyzed['loss']:.7f}"
    )
    assert abs(analyzed["document_loss"] - lm_eval_analyzed) < 1e-3
    assert analyzed["document_loss"] == pytest.approx(lm_eval_analyzed, rel=1e-5)
    if tokenizer.bos_token_id is not None:
        # lm-eval's default prefix is the tokenizer's BOS, which training never put
        # before a document: a different (here higher) loss, hence prefix_token_id.
        default = run_lm_eval(hf_dir, tmp_path / "tasks", None, tasks=("lns_analyzed",))
        with_bos = -sum(s["resps"][0][0] for s in default["samples"]["lns_analyzed"])
        with_bos /= analyzed["document_tokens"]
        print(f"lm-eval with its default BOS prefix {with_bos:.7f}, "
              f"difference {with_bos - lm_eval_analyzed:+.5f} nats")  # fmt: skip
        assert abs(with_bos - lm_eval_analyzed) > 1e-5

    # (a) Perplexity: lm-eval's token loss is its summed log-likelihood over the tokens;
    # with byte tokens its byte perplexity is exp(token loss) as well.
    heldout = results["results"]["lns_heldout"]
    per_document = [-s["resps"][0][0] for s in results["samples"]["lns_heldout"]]
    lm_eval_loss = sum(per_document) / sum(lengths)
    bytes_ = sum(len(doc.encode()) for doc in documents)
    assert math.log(heldout["byte_perplexity,none"]) == pytest.approx(
        sum(per_document) / bytes_, rel=1e-12
    )
    assert heldout["bits_per_byte,none"] * math.log(2) == pytest.approx(
        sum(per_document) / bytes_, rel=1e-12
    )

    model = build_model(model_config(cfg, vocab))
    load_model_weights(model, checkpoint)
    windows = [w for doc in ids for w in rolling_windows(doc, eod, SEQ)]
    batch = megatron_batch(windows, eod)
    model[0].eval()
    project_loss, tokens = held_out_loss(model, [[batch]])
    padding = vocabulary_padding_term(model[0], batch, vocab)
    assert tokens == sum(lengths)
    trimmed_loss = project_loss - padding
    print(
        f"project loss {project_loss:.7f} (padded vocabulary), padding term {padding:.7f}, "
        f"trimmed {trimmed_loss:.7f}, lm-eval {lm_eval_loss:.7f}, "
        f"relative difference {abs(trimmed_loss - lm_eval_loss) / lm_eval_loss:.2e}"
    )
    assert lm_eval_loss == pytest.approx(trimmed_loss, rel=RELATIVE_TOLERANCE)
    # The padding term is real: leaving it out would fail the comparison.
    assert padding > CONTROL_MARGIN * RELATIVE_TOLERANCE * lm_eval_loss

    # Negative control: the last window of each document cut where megatron would cut it.
    left = [w for doc in ids for w in rolling_windows(doc, eod, SEQ, right_align_last=False)]
    left_batch = megatron_batch(left, eod)
    left_loss = held_out_loss(model, [[left_batch]])[0] - vocabulary_padding_term(
        model[0], left_batch, vocab
    )
    print(
        f"last windows left-aligned: loss {left_loss:.7f}, difference {left_loss - lm_eval_loss:.2e}"
    )
    assert abs(left_loss - lm_eval_loss) > CONTROL_MARGIN * RELATIVE_TOLERANCE * lm_eval_loss

    # Negative control: the same token ids scored with the boundaries handled as in
    # training's packed stream (documents concatenated, windows cutting across them).
    stream = [eod, *[t for doc in ids for t in [*doc, eod]]]
    packed = []
    for start in range(0, len(stream) - 1, SEQ):
        tokens_ = stream[start : start + SEQ + 1]
        packed.append((tokens_, len(tokens_) - 1))
    packed_batch = megatron_batch(packed, eod)
    packed_batch["loss_mask"] *= (packed_batch["labels"] != eod).float()  # documents only
    packed_loss, packed_tokens = held_out_loss(model, [[packed_batch]])
    packed_loss -= vocabulary_padding_term(model[0], packed_batch, vocab)
    assert packed_tokens == sum(lengths)
    print(f"packed-stream loss {packed_loss:.7f}, difference {packed_loss - lm_eval_loss:.2e}")
    assert abs(packed_loss - lm_eval_loss) > CONTROL_MARGIN * RELATIVE_TOLERANCE * lm_eval_loss

    # (b) Multiple choice: lm-eval's per-choice log-likelihoods are transformers'.
    samples = results["samples"]["lns_choices"]
    assert len(samples) == len(CHOICE_ITEMS)
    assert 0.0 <= results["results"]["lns_choices"]["acc,none"] <= 1.0
    for sample in samples:
        doc = sample["doc"]
        got = [resp[0][0] for resp in sample["resps"]]
        want = [
            transformers_loglikelihood(hf_model, tokenizer, doc["question"], c)
            for c in doc["choices"]
        ]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)

    assert no_network == [], "something tried to reach the network"
