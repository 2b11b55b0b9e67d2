"""The data pipeline: prepare (txt/jsonl/parquet, byte and BPE), the token file's checks, the
loader's determinism, dp split, resume and validation split."""

import json

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError
from fivefold.data import prepare as prep
from fivefold.data.dataset import corpus_files
from fivefold.data.loader import BatchLoader, TokenDataset, default_corpus_tokens
from fivefold.data.tokenizer import ByteTokenizer, load_tokenizer

DOCS = ["First document.\nWith two lines.", "Zweites Dokument: grüße, 東京 ✓", "third"]


def byte_stream(docs):
    out = []
    for d in docs:
        out += list(d.encode()) + [0]
    return out


def config_error(fn, *words):
    """Call fn, expect a one-line ConfigError containing every word; return the message."""
    with pytest.raises(ConfigError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, (word, msg)
    return msg


@pytest.fixture
def txt_tokens(tmp_path):
    for i, d in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(d, encoding="utf-8")
    out = tmp_path / "out" / "tokens.bin"
    prep.prepare([str(tmp_path / f"doc{i}.txt") for i in range(len(DOCS))], str(out))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return TokenDataset.open(default_corpus_tokens(cache_dir=tmp_path_factory.mktemp("cache")))


# -- tokenizers and prepare ---------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id == 0
    for text in DOCS:
        ids = tok.encode(text)
        assert ids == list(text.encode()) and max(ids) < 256
        assert tok.decode(ids) == text


def test_prepare_txt_byte(txt_tokens, tmp_path):
    meta = json.loads(prep.meta_path(txt_tokens).read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["eos_id"] == 0
    assert meta["num_documents"] == 3 and meta["tokenizer"] == {
        "kind": "byte", "path": None, "vocab_size": 256, "eos_id": 0}
    assert [s["documents"] for s in meta["sources"]] == [1, 1, 1]
    ds = TokenDataset.open(txt_tokens)
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.uint16
    assert ds.tokens.tolist() == byte_stream(DOCS)
    assert meta["num_tokens"] == ds.num_tokens == txt_tokens.stat().st_size // 2
    assert TokenDataset.open(prep.meta_path(txt_tokens)).path == txt_tokens  # either name works
    # NUL is the separator, so NUL inside a text is dropped; empty files add no document.
    (tmp_path / "nul.txt").write_text("a\x00b")
    (tmp_path / "empty.txt").write_text("")
    meta = prep.prepare([str(tmp_path / "nul.txt"), str(tmp_path / "empty.txt")],
                        str(tmp_path / "nul.bin"))
    assert meta["num_documents"] == 1
    assert TokenDataset.open(tmp_path / "nul.bin").tokens.tolist() == [97, 98, 0]


def test_prepare_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": DOCS[0], "id": 1}, {"text": "", "id": 2}, {"text": None, "id": 3},
            {"text": DOCS[1], "id": 4}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"body": [DOCS[2], DOCS[0]], "n": [1, 2]}), tmp_path / "b.parquet")
    meta = prep.prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "a.bin"))
    assert meta["num_documents"] == 2  # the empty and the null row add nothing
    assert TokenDataset.open(tmp_path / "a.bin").tokens.tolist() == byte_stream(DOCS[:2])
    meta = prep.prepare([str(tmp_path / "b.parquet")], str(tmp_path / "b.bin"), text_field="body")
    assert TokenDataset.open(tmp_path / "b.bin").tokens.tolist() == byte_stream([DOCS[2], DOCS[0]])
    # A directory stands for its supported files, sorted: a.jsonl reads, then b.parquet has
    # no 'text'. The metadata written above (a.bin.json sorts first) is an output, skipped.
    config_error(lambda: prep.prepare([str(tmp_path)], str(tmp_path / "c.bin")),
                 "b.parquet", "no field 'text'", "fields: body, n", "--text-field")


def test_prepare_trains_bpe_and_reuses_it(tmp_path, capsys):
    text = "the cat sat on the mat. " * 40 + "a dog ran in the fog. " * 40
    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text(f"{i}: {text}")
    out = tmp_path / "bpe" / "tokens.bin"
    files = [str(tmp_path / f"t{i}.txt") for i in range(3)]
    assert prep.main([*files, "-o", str(out), "--train-tokenizer", "300"]) == 0
    assert "tokens from 3 documents" in capsys.readouterr().out
    tok_path = tmp_path / "bpe" / "tokens.tokenizer.json"
    ds = TokenDataset.open(out)
    assert ds.tokenizer_spec == str(tok_path) and 256 < ds.vocab_size <= 300
    tok = ds.load_tokenizer()
    assert tok.kind == "bpe" and tok.vocab_size == ds.vocab_size and tok.eos_id == ds.eos_id
    ids = ds.tokens.tolist()
    assert len(ids) < sum(len(f"{i}: {text}".encode()) for i in range(3)) / 3  # merges happened
    docs, current = [], []
    for i in ids:
        if i == tok.eos_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(i)
    assert docs == [f"{i}: {text}" for i in range(3)] and current == []
    unseen = "Ünïcödé never seen: 東京 ✓"  # byte-level: any text round-trips
    assert tok.decode(tok.encode(unseen)) == unseen
    # The saved tokenizer.json, given back, reproduces the same tokens.
    prep.prepare(files, str(tmp_path / "again.bin"), tokenizer=str(tok_path))
    assert TokenDataset.open(tmp_path / "again.bin").tokens.tolist() == ids


def test_dtype_follows_vocab_size(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert [prep.dtype_for_vocab(v) for v in (256, 65536, 65537)] == ["uint16", "uint16", "uint32"]
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}
    big = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "w.txt").write_text("w69999 w5 w65536")
    meta = prep.prepare([str(tmp_path / "w.txt")], str(tmp_path / "w.bin"),
                        tokenizer=str(tmp_path / "big.json"))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001
    ds = TokenDataset.open(tmp_path / "w.bin")
    assert ds.tokens.dtype == np.uint32 and ds.tokens.tolist() == [69999, 5, 65536, 70000]
    assert (tmp_path / "w.bin").stat().st_size == 4 * 4


def test_bundled_corpus(corpus, tmp_path):
    size = sum(f.stat().st_size for f in corpus_files())
    assert 500_000 <= size <= 2_000_000 and len(corpus_files()) == corpus.num_documents
    assert corpus.num_tokens == size + corpus.num_documents  # ASCII bytes + one EOS each
    text = load_tokenizer("byte").decode(corpus.tokens[:2000].tolist())
    assert "HAMLET" in text or "Caesar" in text or "Lear" in text
    # Cached: a second call returns the same file untouched; a damaged one is rebuilt.
    first = default_corpus_tokens(cache_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert default_corpus_tokens(cache_dir=tmp_path) == first and first.stat().st_mtime_ns == stamp
    first.write_bytes(first.read_bytes()[:-2])
    assert TokenDataset.open(default_corpus_tokens(cache_dir=tmp_path)).num_tokens == len(corpus)


def test_shipped_corpus_bpe(tmp_path):
    """The default job's tokenizer: the shipped BPE is what training on the corpus gives (so it
    can be remade), round-trips the corpus exactly, and its token file records the name, not
    this install's path, so a checkpoint's tokenizer is found on any install."""
    from fivefold.data.tokenizer import BUILTIN, train_bpe

    tok = load_tokenizer("corpus-bpe")
    assert tok.vocab_size == 2048 and tok.spec == "corpus-bpe"
    remade = train_bpe((f.read_text() for f in corpus_files()), 2048, tmp_path / "bpe.json")
    assert (tmp_path / "bpe.json").read_bytes() == BUILTIN["corpus-bpe"].read_bytes()
    text = corpus_files()[0].read_text()[:20_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(text) / len(ids) > 2.5  # bytes per token
    assert remade.encode(text) == ids
    ds = TokenDataset.open(default_corpus_tokens("corpus-bpe", cache_dir=tmp_path))
    assert ds.meta["tokenizer"]["path"] == "corpus-bpe" and ds.tokenizer_spec == "corpus-bpe"
    assert ds.vocab_size == 2048 and ds.num_documents == len(corpus_files())
    assert 400_000 < ds.num_tokens < 500_000  # 1.25 MB of text at about 2.8 bytes a token


# -- loader -------------------------------------------------------------------------------

def batches(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def flat(batch):
    return [t for pair in batch for t in pair]


def sequences(batch):
    """All inputs and all targets of a list of micro-batches, one row per sequence."""
    return [torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])]


def test_windows_are_shifted_token_slices(corpus):
    loader = BatchLoader(corpus, seq_len=32, gbs=4, mbs=2, seed=7, val_fraction=0.1)
    for step, batch in enumerate(batches(loader, 3)):
        assert len(batch) == 2
        for j, (x, y) in enumerate(batch):
            assert x.shape == y.shape == (2, 32) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            for row in range(2):
                w = loader.window_index(step * 4 + j * 2 + row)
                ref = corpus.tokens[w * 32:w * 32 + 33].astype(np.int64)
                assert x[row].tolist() == ref[:-1].tolist() and y[row].tolist() == ref[1:].tolist()


def test_loader_is_deterministic_and_covers_each_epoch(corpus):
    def make(seed):
        return BatchLoader(corpus, seq_len=64, gbs=8, mbs=4, seed=seed, val_fraction=0.05)

    assert all(same(flat(a), flat(b)) for a, b in zip(batches(make(1), 4), batches(make(1), 4)))
    assert not same(flat(make(1).next_batch()), flat(make(2).next_batch()))
    loader = make(3)
    n = loader.num_samples
    epoch0 = [loader.window_index(g) for g in range(n)]
    epoch1 = [loader.window_index(g) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1


@pytest.mark.parametrize("dp,mbs", [(2, 1), (2, 2), (4, 1)])
def test_dp_ranks_concatenate_to_the_dp1_batch(tmp_path, dp, mbs):
    (tmp_path / "x.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 6)
    prep.prepare([str(tmp_path / "x.txt")], str(tmp_path / "x.bin"))
    ds = TokenDataset.open(tmp_path / "x.bin")
    kw = {"seq_len": 8, "gbs": 8, "mbs": mbs, "seed": 5}
    ref = batches(BatchLoader(ds, **kw), 5)  # 19 windows: the 5 steps cross two epochs
    ranks = [batches(BatchLoader(ds, dp_rank=r, dp=dp, **kw), 5) for r in range(dp)]
    for step in range(5):
        joined = [mb for r in range(dp) for mb in ranks[r][step]]
        assert len(joined) == len(ref[step]) == 8 // mbs
        assert same(flat(joined), flat(ref[step]))
        targets = sum(int((y != -100).sum()) for r in range(dp) for _, y in ranks[r][step])
        assert targets == BatchLoader(ds, **kw).num_target_tokens == 8 * 8


def test_resume_from_state_dict_continues_exactly(corpus):
    kw = {"seq_len": 16, "gbs": 8, "seed": 11, "val_fraction": 0.05}
    run = BatchLoader(corpus, mbs=2, **kw)
    batches(run, 3)
    state = run.state_dict()
    following = batches(run, 4)
    resumed = BatchLoader(corpus, mbs=2, **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives serialisation
    assert all(same(flat(a), flat(b)) for a, b in zip(batches(resumed, 4), following))
    # Layout-independent: resuming as dp=2 gives the same global batches.
    halves = [BatchLoader(corpus, mbs=1, dp=2, dp_rank=r, **kw) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for expected in following:  # compare sequences: the micro-batch sizes differ (1 vs 2)
        got = halves[0].next_batch() + halves[1].next_batch()
        assert same(sequences(got), sequences(expected))
    other = BatchLoader(corpus, mbs=2, **{**kw, "seed": 12})
    config_error(lambda: other.load_state_dict(state), "seed", "train.seed")
    config_error(lambda: other.load_state_dict({"step": 3}), "no train data-loader position")


def test_validation_split_is_held_out_and_repeatable(corpus):
    kw = {"seq_len": 64, "gbs": 4, "mbs": 2, "seed": 3, "val_fraction": 0.05}
    train, val = BatchLoader(corpus, **kw), BatchLoader(corpus, split="val", **kw)
    assert train.end == val.start and val.end == corpus.num_tokens
    assert val.end - val.start == int(corpus.num_tokens * 0.05)
    first = val.next_batch()
    starts = [val.start + val.window_index(g) * 64 for g in range(val.num_samples)]
    assert min(starts) >= train.end and max(starts) + 65 <= corpus.num_tokens
    assert max(train.window_index(g) for g in range(train.num_samples)) * 64 + 65 <= train.end
    val.next_batch()
    val.reset()
    assert same(flat(val.next_batch()), flat(first))
    assert same(flat(first), flat(BatchLoader(corpus, split="val", **{**kw, "seed": 9})
                                  .next_batch()))  # in order: independent of the seed


# -- errors -------------------------------------------------------------------------------

def rewrite_meta(path, **changes):
    mp = prep.meta_path(path)
    meta = json.loads(mp.read_text())
    meta.update(changes)
    mp.write_text(json.dumps(meta))


def test_token_file_errors(txt_tokens, tmp_path):
    config_error(lambda: TokenDataset.open(tmp_path / "nope.bin"), "nope.bin", "does not exist",
                 "fivefold prepare")
    stray = tmp_path / "stray.bin"
    stray.write_bytes(b"\0\0")
    config_error(lambda: TokenDataset.open(stray), "no metadata", "re-run `fivefold prepare`")
    good = prep.meta_path(txt_tokens).read_text()
    prep.meta_path(txt_tokens).write_text("{not json")
    config_error(lambda: TokenDataset.open(txt_tokens), "garbled", "re-run")
    prep.meta_path(txt_tokens).write_text(json.dumps({"format": "fivefold-tokens"}))
    config_error(lambda: TokenDataset.open(txt_tokens), "garbled", "'version'")
    for changes, words in [({"dtype": "int8"}, ["dtype 'int8'", "uint16 or uint32"]),
                           ({"vocab_size": 70_000}, ["70000 does not fit dtype uint16"]),
                           ({"dtype": "uint32"}, ["bytes", "uint32", "truncated"]),
                           ({"num_tokens": 3}, ["bytes", "metadata says 3"]),
                           ({"vocab_size": 100, "eos_id": 0}, ["token id", "vocab_size 100"])]:
        prep.meta_path(txt_tokens).write_text(good)
        rewrite_meta(txt_tokens, **changes)
        config_error(lambda: TokenDataset.open(txt_tokens), str(txt_tokens.name), *words)
    prep.meta_path(txt_tokens).write_text(good)
    data = bytearray(txt_tokens.read_bytes())
    data[0] ^= 1  # same size, different content: only the checksum sees it
    txt_tokens.write_bytes(bytes(data))
    assert TokenDataset.open(txt_tokens).num_tokens == len(data) // 2
    config_error(lambda: TokenDataset.open(txt_tokens, checksum=True), "sha256")
    txt_tokens.write_bytes(bytes(data[:-2]))
    config_error(lambda: TokenDataset.open(txt_tokens), "truncated")


def test_prepare_errors(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.csv").write_text("text\nhi\n")
    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "noeos.json").write_text(
        '{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}')
    out = str(tmp_path / "o.bin")
    config_error(lambda: prep.prepare([str(tmp_path / "empty.txt")], out), "no text")
    assert not (tmp_path / "o.bin").exists()
    config_error(lambda: prep.prepare([str(tmp_path / "missing.txt")], out), "does not exist")
    config_error(lambda: prep.prepare([str(tmp_path / "a.csv")], out), "'.csv'", ".jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    (tmp_path / "bad.parquet").write_text("not parquet")
    for name in ("bad.jsonl", "bad.parquet"):
        config_error(lambda n=name: prep.prepare([str(tmp_path / n)], out), name, "cannot read")
    config_error(lambda: prep.prepare([str(tmp_path / "t.txt")], out, tokenizer=str(
        tmp_path / "t.txt"), train_tokenizer=300), "not both")
    config_error(lambda: prep.prepare([str(tmp_path / "t.txt")], out, train_tokenizer=100),
                 "too small", "257")
    config_error(lambda: load_tokenizer(tmp_path / "bad.json"), "not a valid tokenizer.json")
    config_error(lambda: load_tokenizer(tmp_path / "noeos.json"), "no end-of-text token")
    config_error(lambda: load_tokenizer(tmp_path / "gone.json"), "does not exist")
    assert prep.main([str(tmp_path / "empty.txt"), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fivefold prepare: error:") and err.count("\n") == 1


def test_loader_errors(txt_tokens):
    ds = TokenDataset.open(txt_tokens)  # 76 tokens
    config_error(lambda: BatchLoader(ds, seq_len=76, gbs=1), "fewer than train.seq_len + 1 = 77",
                 "lower train.seq_len")
    assert BatchLoader(ds, seq_len=75, gbs=1).num_samples == 1
    config_error(lambda: BatchLoader(ds, seq_len=8, gbs=1, split="val"), "val_fraction = 0")
    config_error(lambda: BatchLoader(ds, seq_len=8, gbs=2, split="val", val_fraction=0.1),
                 "7 val tokens", "raise data.val_fraction")
    config_error(lambda: BatchLoader(ds, seq_len=8, gbs=6, mbs=2, dp=2), "gbs = 6")
