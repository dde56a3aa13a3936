"""Token sources and the sampler that turns a global sample index into a training sequence.

A sample is seq_len + 1 consecutive tokens (inputs and their next-token labels). Samples are
addressed by a global index, so the data position saved in a checkpoint is one integer and a
resumed run reads exactly the samples the uninterrupted run would have read.
"""
import glob
import os
from pathlib import Path

import torch

from ringfa4 import documents
from ringfa4.train.config import ConfigError

CORPUS_DIR = Path(__file__).parent / "corpus"
BYTE_VOCAB = 256
TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


class TokenStream:
    """A flat 1-D tensor of token ids (in memory, or memory-mapped from a file)."""

    def __init__(self, tokens, vocab_size, source):
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.source = source

    def __len__(self):
        return len(self.tokens)

    def window(self, start, length):
        return self.tokens[start:start + length].to(torch.int64)


def text_stream(paths):
    """Bytes of the given text files (globs allowed), one file after another: byte-level tokens 0..255.

    With no paths, the small corpus shipped in the package (ringfa4/train/corpus/*.txt).
    """
    if not paths:
        files = sorted(str(p) for p in CORPUS_DIR.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"data.paths is empty and the shipped corpus {CORPUS_DIR} holds no .txt file")
    else:
        files = []
        for pattern in paths:
            matched = sorted(glob.glob(os.path.expanduser(pattern)))
            if not matched:
                raise FileNotFoundError(f"data.paths entry {pattern!r} matches no file")
            folders = [m for m in matched if os.path.isdir(m)]
            if folders:
                raise ConfigError(f"data.paths entry {pattern!r} matches the directory {folders[0]!r}: name "
                                  f"files, or a glob of them such as {os.path.join(folders[0], '*.txt')!r}")
            files += matched
    data = b"".join(Path(f).read_bytes() for f in files)
    if not data:
        raise ConfigError(f"data.paths {paths!r}: the {len(files)} file(s) it names are empty")
    return TokenStream(torch.frombuffer(bytearray(data), dtype=torch.uint8), BYTE_VOCAB, f"{len(files)} text file(s)")


def token_file_stream(path, dtype):
    """A raw memory-mapped file of token ids, as nanoGPT's prepare scripts and Megatron's .bin write them."""
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.path {path!r} is not a file")
    itemsize = TOKEN_DTYPES[dtype].itemsize
    size = os.path.getsize(path)
    if size == 0 or size % itemsize:
        raise ConfigError(f"data.path {path!r} has {size} bytes, not a positive multiple of "
                         f"{itemsize} (data.dtype={dtype})")
    # shared=False maps the file privately: pages are read when a window touches them.
    tokens = torch.from_file(path, shared=False, size=size // itemsize, dtype=TOKEN_DTYPES[dtype])
    return TokenStream(tokens, None, path)


class StreamSampler:
    """Sample i: a window of seq_len + 1 tokens starting at a multiple of seq_len, windows visited
    in a fresh seeded permutation each epoch."""

    def __init__(self, stream, seq_len, seed):
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.windows = (len(stream) - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(f"the data ({stream.source}) holds {len(stream)} tokens, fewer than "
                             f"train.seq_len + 1 = {seq_len + 1}")
        self._epoch, self._order = None, None

    def __getitem__(self, index):
        epoch, i = divmod(index, self.windows)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.windows, generator=gen)
        return self.stream.window(int(self._order[i]) * self.seq_len, self.seq_len + 1)


class SyntheticSampler:
    """Sample i: uniformly random tokens from a generator seeded by (seed, i); for throughput runs."""

    def __init__(self, vocab_size, seq_len, seed):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __getitem__(self, index):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)


class DocumentBoundaries:
    """Where documents start in the samples: right after each occurrence of ``end`` (a tuple of
    token ids: data.eod_token, or the bytes of data.document_separator), inside the sample's inputs.
    A sample's first token starts a document whatever precedes it: the window is all we attend over."""

    def __init__(self, end):
        self.end = torch.tensor(end, dtype=torch.int64)

    def starts(self, inputs):
        """(b, s) bool: True where a document starts (always at position 0)."""
        b, s = inputs.shape
        n = len(self.end)
        ends = torch.ones(b, max(s - n + 1, 0), dtype=torch.bool)
        for i in range(n):
            ends &= inputs[:, i:s - n + 1 + i] == self.end[i]
        starts = torch.zeros(b, s, dtype=torch.bool)
        starts[:, n:] = ends[:, :s - n]
        starts[:, 0] = True
        return starts

    def cu_seqlens(self, inputs):
        """FlashAttention's varlen boundaries over the packed batch (b * s), int32 on the CPU."""
        return documents.from_starts(self.starts(inputs))

    def positions(self, inputs):
        """(b, s) positions counted from each token's document start."""
        starts = self.starts(inputs)
        index = torch.arange(inputs.shape[1]).expand_as(inputs)
        return index - torch.where(starts, index, 0).cummax(dim=1).values


def build_sampler(data_cfg, seq_len, vocab_size, seed):
    """The sampler for ``data_cfg`` (a config.DataConfig); raises naming the setting on missing or
    empty files or a vocabulary the model cannot embed."""
    if data_cfg.kind == "synthetic":
        return SyntheticSampler(vocab_size, seq_len, seed)
    if data_cfg.kind == "text":
        stream = text_stream(data_cfg.paths)
    else:
        stream = token_file_stream(data_cfg.path, data_cfg.dtype)
    if stream.vocab_size is not None and stream.vocab_size > vocab_size:
        raise ConfigError(f"data.kind={data_cfg.kind} has {stream.vocab_size} token ids but model.vocab_size={vocab_size}")
    return StreamSampler(stream, seq_len, seed)


def load_samples(sampler, start, count, vocab_size):
    """Samples start .. start+count-1 stacked as (count, seq_len + 1), checked against the model's vocabulary."""
    x = torch.stack([sampler[start + j] for j in range(count)])
    if int(x.max()) >= vocab_size:
        raise ValueError(f"token id {int(x.max())} in samples {start}..{start + count - 1} is not below "
                         f"model.vocab_size={vocab_size}")
    return x
