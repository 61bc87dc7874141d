"""A prefix tree over token sequences, stored as flat CSR tensors (no Python node objects).

Layout (``N`` nodes, ``E = N - 1`` edges, ``R`` terminal rows). Every array is a 1-D **int32**
tensor: node ids, tokens, depths and counts all fit in 31 bits, and int32 halves the footprint of
a trie of millions of ads (the ``codes`` scheme targets <= 64 bytes per ad). Every method returns
int64 (``Long``) tensors; cast an array with ``.long()`` before using it as a ``gather`` index or a
``searchsorted`` operand.

- ``child_ptr [N+1]``, ``child_tokens [E]``, ``child_ids [E]``: the children of node ``n`` are
  ``child_ids[child_ptr[n]:child_ptr[n+1]]``, entered by ``child_tokens[...]`` in ascending order.
- ``parent [N]`` (-1 at the root), ``token [N]`` (token on the edge into the node, -1 at the root),
  ``depth [N]`` (root 0).
- ``subtree_nodes [N]`` (nodes in the subtree, itself included), ``subtree_terminals [N]``
  (complete sequences, counted with multiplicity, ending at or below), ``height [N]`` (longest
  remaining path to a node below; 0 for a leaf).
- ``terminal_ptr [N+1]``, ``terminal_rows [R]``: the ad rows whose sequence ends exactly at a node
  (ascending; identical sequences give several rows). A node is terminal iff it has >= 1 row.

Node ids are assigned in **depth-first preorder** with siblings in token order, so the subtree of
``n`` is the contiguous id range ``[n, n + subtree_nodes[n])``. That makes :meth:`Trie.suffixes` a
slice, and it is checked by :meth:`Trie.load`.

On disk the trie is one safetensors file (a JSON header followed by raw little-endian arrays);
:meth:`Trie.load` memory-maps it, so opening a trie of millions of nodes reads only the header
until the arrays are touched.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from adbatch.artifacts import atomic_path

TRIE_FORMAT = "adbatch-trie"
TRIE_FORMAT_VERSION = 1
_DTYPE = torch.int32
_NP_DTYPE = np.int32

#: array name -> length in terms of (num_nodes, num_edges, num_rows)
_ARRAYS = (
    "child_ptr", "child_tokens", "child_ids", "parent", "token", "depth",
    "subtree_nodes", "subtree_terminals", "height", "terminal_ptr", "terminal_rows",
)


class TrieFormatError(ValueError):
    """A trie file or array set violates the layout documented in :mod:`adbatch.index.trie`."""


@dataclasses.dataclass
class TokenTree:
    """The token tree below a trie node, in an order where parents precede children.

    All tensors are ``Long[T]`` on the trie's device:
    ``tokens`` (token of each tree position), ``parent_index`` (-1 when the position hangs off the
    query node itself, else the index of its parent position, always smaller than its own index),
    ``depth`` (1 = child of the query node), ``node_ids`` (the trie node of each position).
    """

    tokens: torch.Tensor
    parent_index: torch.Tensor
    depth: torch.Tensor
    node_ids: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Trie:
    """Flat-tensor prefix tree; see the module docstring for the layout."""

    def __init__(self, arrays: dict[str, torch.Tensor], vocab_upper_bound: int, max_degree: int,
                 validate: bool = True) -> None:
        missing = [k for k in _ARRAYS if k not in arrays]
        if missing:
            raise TrieFormatError(f"trie arrays missing: {missing}")
        for name in _ARRAYS:
            setattr(self, name, arrays[name])
        self.vocab_upper_bound = int(vocab_upper_bound)
        self.max_degree = int(max_degree)
        if validate:
            self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]],
                       rows: Sequence[int] | None = None) -> "Trie":
        """Build the trie of ``sequences`` (lists of non-negative token ids, each non-empty).

        ``rows[i]`` is the ad row that ``sequences[i]`` denotes (default ``i``).
        """
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64,
                           count=int(lengths.sum()))
        row_arr = None if rows is None else np.asarray(list(rows), dtype=np.int64)
        return cls.from_flat(flat, lengths, row_arr)

    @classmethod
    def from_flat(cls, flat: np.ndarray, lengths: np.ndarray,
                  rows: np.ndarray | None = None) -> "Trie":
        """Build from concatenated sequences.

        Args:
            flat: ``int[sum(lengths)]`` all tokens, sequence after sequence.
            lengths: ``int[S]`` length of each sequence (>= 1).
            rows: ``int[S]`` ad row of each sequence (default ``arange(S)``), each >= 0.
        """
        flat = np.asarray(flat, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        n_seq = int(lengths.shape[0])
        if n_seq == 0:
            raise ValueError("Trie needs at least one sequence")
        if lengths.min() < 1:
            bad = int(np.argmin(lengths))
            raise ValueError(f"sequence {bad} is empty; every sequence needs >= 1 token")
        if int(lengths.sum()) != flat.shape[0]:
            raise ValueError(f"sum(lengths)={int(lengths.sum())} != len(flat)={flat.shape[0]}")
        if flat.min() < 0 or flat.max() >= np.iinfo(_NP_DTYPE).max:
            raise ValueError("tokens must lie in [0, 2**31 - 1)")
        rows = np.arange(n_seq, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        if rows.shape != (n_seq,):
            raise ValueError(f"rows has shape {rows.shape}, expected ({n_seq},)")
        if n_seq and rows.min() < 0:
            raise ValueError("rows must be >= 0")

        max_len = int(lengths.max())
        # Right-pad with -1, which sorts before every token, so a prefix sorts before its
        # extensions and lexicographic order of rows == depth-first preorder of the trie.
        padded = np.full((n_seq, max_len), -1, dtype=np.int32)
        padded[np.arange(max_len)[None, :] < lengths[:, None]] = flat
        order = np.lexsort(padded.T[::-1])
        padded, lengths, rows = padded[order], lengths[order], rows[order]

        # Longest common prefix with the previous sequence in sorted order.
        lcp = np.zeros(n_seq, dtype=np.int64)
        if n_seq > 1:
            eq = padded[1:] == padded[:-1]
            lcp[1:] = np.minimum(np.cumprod(eq, axis=1, dtype=np.int8).sum(axis=1, dtype=np.int64),
                                 np.minimum(lengths[1:], lengths[:-1]))
        new_count = lengths - lcp
        first_new = 1 + np.concatenate([[0], np.cumsum(new_count)[:-1]])  # id of first new node
        num_nodes = 1 + int(new_count.sum())

        parent = np.full(num_nodes, -1, dtype=np.int64)
        token = np.full(num_nodes, -1, dtype=np.int64)
        depth = np.zeros(num_nodes, dtype=np.int64)
        term_node = np.zeros(n_seq, dtype=np.int64)
        prev_col = np.zeros(n_seq, dtype=np.int64)  # node of each sequence at depth d-1
        for d in range(1, max_len + 1):  # loop over depth (<= sequence length), vectorized over rows
            alive = lengths >= d
            is_new = alive & (lcp < d)
            col = np.where(is_new, first_new + (d - lcp - 1), 0)
            # New ids grow along the sorted order; a row that shares depth d with its predecessor
            # (lcp >= d) inherits the latest id, which is exactly the running maximum.
            col = np.maximum.accumulate(col)
            ids = col[is_new]
            parent[ids] = prev_col[is_new]
            token[ids] = padded[:, d - 1][is_new]
            depth[ids] = d
            ends = lengths == d
            term_node[ends] = col[ends]
            prev_col = col

        # CSR children: edges sorted by parent; preorder already sorts siblings by token.
        child_ids = np.argsort(parent[1:], kind="stable") + 1
        child_tokens = token[child_ids]
        child_ptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(parent[1:], minlength=num_nodes), out=child_ptr[1:])

        # Terminal CSR, rows ascending within a node.
        t_order = np.lexsort((rows, term_node))
        terminal_rows = rows[t_order]
        term_counts = np.bincount(term_node, minlength=num_nodes)
        terminal_ptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(term_counts, out=terminal_ptr[1:])

        subtree_nodes = np.ones(num_nodes, dtype=np.int64)
        subtree_terminals = term_counts.astype(np.int64)
        height = np.zeros(num_nodes, dtype=np.int64)
        by_depth = np.argsort(depth, kind="stable")
        depth_ptr = np.searchsorted(depth[by_depth], np.arange(max_len + 2))
        for d in range(max_len, 0, -1):  # bottom-up over levels
            ids = by_depth[depth_ptr[d]:depth_ptr[d + 1]]
            par = parent[ids]
            np.add.at(subtree_nodes, par, subtree_nodes[ids])
            np.add.at(subtree_terminals, par, subtree_terminals[ids])
            np.maximum.at(height, par, height[ids] + 1)

        degree = np.diff(child_ptr)
        arrays = {
            "child_ptr": child_ptr, "child_tokens": child_tokens, "child_ids": child_ids,
            "parent": parent, "token": token, "depth": depth, "subtree_nodes": subtree_nodes,
            "subtree_terminals": subtree_terminals, "height": height,
            "terminal_ptr": terminal_ptr, "terminal_rows": terminal_rows,
        }
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=_NP_DTYPE))
                   for k, v in arrays.items()}
        return cls(tensors, vocab_upper_bound=int(flat.max()) + 1,
                   max_degree=int(degree.max()), validate=False)

    # ------------------------------------------------------------------ properties
    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.child_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.terminal_rows.shape[0])

    @property
    def device(self) -> torch.device:
        return self.parent.device

    @property
    def max_depth(self) -> int:
        return int(self.height[0])

    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(getattr(self, k).numel() * getattr(self, k).element_size() for k in _ARRAYS)

    def arrays(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in _ARRAYS}

    def to(self, device: torch.device | str) -> "Trie":
        """A copy whose arrays live on ``device``."""
        moved = {k: v.to(device) for k, v in self.arrays().items()}
        return Trie(moved, self.vocab_upper_bound, self.max_degree, validate=False)

    def __repr__(self) -> str:
        return (f"Trie(num_nodes={self.num_nodes}, num_rows={self.num_rows}, "
                f"max_depth={self.max_depth}, max_degree={self.max_degree}, "
                f"vocab_upper_bound={self.vocab_upper_bound}, device={self.device})")

    # ------------------------------------------------------------------ batched queries
    def _nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        if nodes.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"nodes must be an integer tensor, got {nodes.dtype}")
        return nodes.to(device=self.device, dtype=torch.int64)

    def degree(self, nodes: torch.Tensor) -> torch.Tensor:
        """Number of children. ``nodes: Long[B]`` (-1 allowed) -> ``Long[B]`` (0 for -1)."""
        n = self._nodes(nodes)
        safe = n.clamp(min=0)
        deg = (self.child_ptr[safe + 1] - self.child_ptr[safe]).long()
        return torch.where(n >= 0, deg, torch.zeros_like(deg))

    def children_padded(self, nodes: torch.Tensor, width: int | None = None, check_width: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Children of a batch of nodes, right-padded with -1.

        Args:
            nodes: ``Long[B]`` node ids; -1 entries get no children.
            width: pad width ``C``; default the largest degree in the batch (one device sync).
            check_width: refuse a ``width`` below the batch's largest degree (one device sync).
                A caller that knows the degrees on the host already (beam search, every step)
                passes False: children past ``width`` would be silently dropped otherwise.
        Returns:
            ``(tokens Long[B, C], child_nodes Long[B, C])`` with tokens ascending per row.
        """
        n = self._nodes(nodes)
        deg = self.degree(n)
        if width is None:
            width = int(deg.max()) if n.numel() else 0
        elif check_width and n.numel() and int(deg.max()) > width:
            raise ValueError(f"width={width} < largest degree {int(deg.max())} in the batch")
        start = self.child_ptr[n.clamp(min=0)].long()                       # [B]
        offs = torch.arange(width, device=self.device, dtype=torch.int64)   # [C]
        valid = offs[None, :] < deg[:, None]                                 # [B, C]
        idx = (start[:, None] + offs[None, :]).clamp(max=max(self.num_edges - 1, 0))
        if self.num_edges == 0:
            empty = torch.full((n.shape[0], width), -1, dtype=torch.int64, device=self.device)
            return empty, empty.clone()
        minus = torch.full((), -1, dtype=torch.int64, device=self.device)
        tokens = torch.where(valid, self.child_tokens[idx].long(), minus)
        child_nodes = torch.where(valid, self.child_ids[idx].long(), minus)
        return tokens, child_nodes

    def allowed_mask(self, nodes: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Tokens that extend each node's prefix.

        Args:
            nodes: ``Long[B]``; -1 rows are all False.
            vocab_size: ``V``, at least :attr:`vocab_upper_bound`.
        Returns:
            ``Bool[B, V]``.
        """
        if vocab_size < self.vocab_upper_bound:
            raise ValueError(f"vocab_size={vocab_size} < trie vocab_upper_bound="
                             f"{self.vocab_upper_bound}")
        tokens, _ = self.children_padded(nodes)
        mask = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.bool, device=self.device)
        # Padding (-1) is routed to the spare column V, then dropped.
        mask.scatter_(1, torch.where(tokens >= 0, tokens, vocab_size), True)
        return mask[:, :vocab_size]

    def step(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Follow one edge per batch element.

        Args:
            nodes: ``Long[B]`` current nodes (-1 = dead).
            tokens: ``Long[B]`` token to follow.
        Returns:
            ``Long[B]`` the child entered by ``tokens``, or -1 when there is none or ``nodes`` is -1.
        """
        n = self._nodes(nodes)
        tok = tokens.to(device=self.device, dtype=torch.int64)
        if n.shape != tok.shape:
            raise ValueError(f"nodes {tuple(n.shape)} and tokens {tuple(tok.shape)} differ")
        if self.num_edges == 0:
            return torch.full_like(n, -1)
        safe = n.clamp(min=0)
        lo = self.child_ptr[safe].long()
        hi = self.child_ptr[safe + 1].long()
        end = hi.clone()
        # Branch-free binary search over each node's sorted child tokens; the iteration count
        # is fixed by the largest degree, so there is no data-dependent sync.
        last = self.num_edges - 1
        for _ in range(max(self.max_degree, 1).bit_length()):
            mid = (lo + hi) // 2
            go_right = (self.child_tokens[mid.clamp(max=last)].long() < tok) & (lo < hi)
            lo = torch.where(go_right, mid + 1, lo)
            hi = torch.where(go_right | (lo >= hi), hi, mid)
        found = (lo < end) & (self.child_tokens[lo.clamp(max=last)].long() == tok) & (n >= 0)
        return torch.where(found, self.child_ids[lo.clamp(max=last)].long(),
                           torch.full_like(n, -1))

    def walk(self, sequences: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """Walk padded sequences from ``start`` (default the root).

        Args:
            sequences: ``Long[B, L]`` tokens, padded with -1 (padding leaves the node unchanged).
            start: ``Long[B]`` start nodes.
        Returns:
            ``Long[B]`` node reached, -1 where the walk fell off the trie.
        """
        seqs = sequences.to(device=self.device, dtype=torch.int64)
        node = (torch.zeros(seqs.shape[0], dtype=torch.int64, device=self.device)
                if start is None else self._nodes(start))
        for j in range(seqs.shape[1]):  # loop over positions, batched over sequences
            col = seqs[:, j]
            node = torch.where(col >= 0, self.step(node, col.clamp(min=0)), node)
        return node

    def is_terminal(self, nodes: torch.Tensor) -> torch.Tensor:
        """``nodes: Long[B]`` -> ``Bool[B]`` (False for -1)."""
        n = self._nodes(nodes)
        safe = n.clamp(min=0)
        return (self.terminal_ptr[safe + 1] > self.terminal_ptr[safe]) & (n >= 0)

    def rows_at(self, node: int) -> torch.Tensor:
        """Ad rows whose sequence ends exactly at ``node``: ``Long[r]`` (ascending)."""
        self._check_node(node)
        a, b = int(self.terminal_ptr[node]), int(self.terminal_ptr[node + 1])
        return self.terminal_rows[a:b].long()

    def rows_below(self, node: int) -> torch.Tensor:
        """Ad rows whose sequence ends at or below ``node``: ``Long[subtree_terminals[node]]``.

        Contiguous because node ids are in preorder.
        """
        self._check_node(node)
        end = node + int(self.subtree_nodes[node])
        a, b = int(self.terminal_ptr[node]), int(self.terminal_ptr[end])
        return self.terminal_rows[a:b].long()

    def suffixes(self, node: int) -> TokenTree:
        """The token tree strictly below ``node`` (``subtree_nodes[node] - 1`` positions)."""
        self._check_node(node)
        start, end = node + 1, node + int(self.subtree_nodes[node])
        ids = torch.arange(start, end, device=self.device, dtype=torch.int64)
        # Preorder: the subtree is the id range itself, and a child of ``node`` maps to -1.
        return TokenTree(
            tokens=self.token[start:end].long(),
            parent_index=self.parent[start:end].long() - start,
            depth=self.depth[start:end].long() - int(self.depth[node]),
            node_ids=ids,
        )

    def sequences_below(self, node: int) -> list[tuple[list[int], list[int]]]:
        """(suffix tokens, rows) for every terminal at or below ``node``; for tests and debugging."""
        out = []
        tree = self.suffixes(node)
        toks = tree.tokens.tolist()
        par = tree.parent_index.tolist()
        paths: list[list[int]] = []
        for i in range(len(toks)):
            paths.append((paths[par[i]] if par[i] >= 0 else []) + [toks[i]])
        here = self.rows_at(node).tolist()
        if here:
            out.append(([], here))
        for i, nid in enumerate(tree.node_ids.tolist()):
            rows = self.rows_at(nid).tolist()
            if rows:
                out.append((paths[i], rows))
        return out

    def _check_node(self, node: int) -> None:
        if not 0 <= int(node) < self.num_nodes:
            raise IndexError(f"node {node} out of range [0, {self.num_nodes})")

    # ------------------------------------------------------------------ persistence
    def metadata(self) -> dict[str, str]:
        return {
            "format": TRIE_FORMAT, "format_version": str(TRIE_FORMAT_VERSION),
            "num_nodes": str(self.num_nodes), "num_edges": str(self.num_edges),
            "num_rows": str(self.num_rows), "vocab_upper_bound": str(self.vocab_upper_bound),
            "max_degree": str(self.max_degree),
        }

    def save(self, path: str | Path) -> None:
        """Write one safetensors file atomically (int32 arrays, little-endian).

        Written by hand rather than with ``safetensors.save_file`` because that orders the
        metadata keys arbitrarily, and equal tries must give byte-identical files (the index hash
        covers the file).
        """
        blobs = {k: np.ascontiguousarray(v.detach().to("cpu", _DTYPE).numpy(), dtype="<i4")
                 for k, v in sorted(self.arrays().items())}
        header: dict[str, object] = {"__metadata__": self.metadata()}
        offset = 0
        for name, arr in blobs.items():
            header[name] = {"dtype": "I32", "shape": [int(arr.shape[0])],
                            "data_offsets": [offset, offset + arr.nbytes]}
            offset += arr.nbytes
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keeps the arrays 8-byte aligned for memory mapping
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(struct.pack("<Q", len(raw)))
                fh.write(raw)
                for arr in blobs.values():
                    fh.write(arr.tobytes())

    @classmethod
    def load(cls, path: str | Path, mmap: bool = True, validate: bool = True) -> "Trie":
        """Open a trie file; ``mmap=True`` maps it instead of reading it. Validated unless told not."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"trie file not found: {path}")
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise TrieFormatError(f"{path}: truncated header")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > 100_000_000:
                raise TrieFormatError(f"{path}: implausible header length {header_len}")
            try:
                header = json.loads(fh.read(header_len))
            except json.JSONDecodeError as exc:
                raise TrieFormatError(f"{path}: header is not JSON ({exc})") from None
        meta = header.pop("__metadata__", {}) or {}
        if meta.get("format") != TRIE_FORMAT:
            raise TrieFormatError(f"{path}: not an adbatch trie (format={meta.get('format')!r})")
        if meta.get("format_version") != str(TRIE_FORMAT_VERSION):
            raise TrieFormatError(f"{path}: trie format version {meta.get('format_version')} "
                                  f"!= supported {TRIE_FORMAT_VERSION}")
        data_start = 8 + header_len
        file_size = path.stat().st_size
        if mmap:
            buf = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable, lazy
        else:
            buf = np.fromfile(path, dtype=np.uint8)
        arrays: dict[str, torch.Tensor] = {}
        for name in _ARRAYS:
            if name not in header:
                raise TrieFormatError(f"{path}: array {name!r} missing")
            info = header[name]
            if info.get("dtype") != "I32" or len(info.get("shape", [])) != 1:
                raise TrieFormatError(f"{path}: array {name!r} must be 1-D I32, got {info}")
            a, b = info["data_offsets"]
            if not 0 <= a <= b <= file_size - data_start or (b - a) != 4 * info["shape"][0]:
                raise TrieFormatError(f"{path}: array {name!r} has bad offsets {a}..{b}")
            arr = buf[data_start + a:data_start + b].view(np.int32)
            arrays[name] = torch.from_numpy(arr)
        trie = cls(arrays, int(meta["vocab_upper_bound"]), int(meta["max_degree"]),
                   validate=False)
        expect = {"num_nodes": trie.num_nodes, "num_edges": trie.num_edges,
                  "num_rows": trie.num_rows}
        for key, val in expect.items():
            if int(meta.get(key, -1)) != val:
                raise TrieFormatError(f"{path}: metadata {key}={meta.get(key)} but arrays give {val}")
        if validate:
            trie.validate()
        return trie

    def validate(self) -> None:
        """Check every structural invariant of the layout; raise :class:`TrieFormatError`."""
        a = {k: getattr(self, k).to("cpu").long() for k in _ARRAYS}
        n, e, r = a["parent"].shape[0], a["child_ids"].shape[0], a["terminal_rows"].shape[0]

        def need(cond: bool | torch.Tensor, what: str) -> None:
            if not bool(cond):
                raise TrieFormatError(f"invalid trie: {what}")

        need(n >= 1, "no root")
        need(e == n - 1, f"num_edges {e} != num_nodes - 1 = {n - 1}")
        for name in ("token", "depth", "subtree_nodes", "subtree_terminals", "height"):
            need(a[name].shape[0] == n, f"{name} has length {a[name].shape[0]}, expected {n}")
        for name in ("child_ptr", "terminal_ptr"):
            ptr = a[name]
            need(ptr.shape[0] == n + 1, f"{name} has length {ptr.shape[0]}, expected {n + 1}")
            need(ptr[0] == 0 and (ptr[1:] >= ptr[:-1]).all(), f"{name} is not non-decreasing from 0")
        need(a["child_ptr"][-1] == e, "child_ptr[-1] != num_edges")
        need(a["terminal_ptr"][-1] == r, "terminal_ptr[-1] != len(terminal_rows)")
        need(a["child_tokens"].shape[0] == e, "child_tokens length != num_edges")
        need(a["parent"][0] == -1 and a["token"][0] == -1 and a["depth"][0] == 0, "bad root")
        ids = torch.arange(n)
        par, child = a["parent"][1:], ids[1:]
        need((par >= 0).all() and (par < child).all(), "parent ids must precede their children")
        need((a["token"][1:] >= 0).all(), "negative token on an edge")
        need((a["token"][1:] < self.vocab_upper_bound).all(), "token >= vocab_upper_bound")
        need((a["depth"][1:] == a["depth"][par] + 1).all(), "depth != parent depth + 1")
        # CSR edges agree with parent/token, and siblings are sorted by token.
        edge_parent = torch.repeat_interleave(ids, a["child_ptr"][1:] - a["child_ptr"][:-1])
        cids = a["child_ids"]
        need(((cids >= 1) & (cids < n)).all(), "child_ids out of range")
        need((a["parent"][cids] == edge_parent).all(), "child_ids disagree with parent")
        need((a["token"][cids] == a["child_tokens"]).all(), "child_tokens disagree with token")
        if e > 1:
            same = edge_parent[1:] == edge_parent[:-1]
            need((a["child_tokens"][1:][same] > a["child_tokens"][:-1][same]).all(),
                 "child tokens not strictly ascending within a node")
        sub = a["subtree_nodes"]
        need((child < par + sub[par]).all() and (child + sub[child] <= par + sub[par]).all(),
             "node ids are not in depth-first preorder")
        total = torch.ones(n, dtype=torch.int64).index_add_(0, par, sub[1:])
        need((total == sub).all(), "subtree_nodes != 1 + sum over children")
        own = a["terminal_ptr"][1:] - a["terminal_ptr"][:-1]
        tt = own.clone().index_add_(0, par, a["subtree_terminals"][1:])
        need((tt == a["subtree_terminals"]).all(), "subtree_terminals inconsistent")
        hgt = torch.zeros(n, dtype=torch.int64).scatter_reduce_(
            0, par, a["height"][1:] + 1, reduce="amax")
        need((hgt == a["height"]).all(), "height inconsistent")
        leaves = (a["child_ptr"][1:] == a["child_ptr"][:-1])
        need((own[leaves] >= 1).all(), "a leaf ends no sequence")
        need(r == 0 or (a["terminal_rows"] >= 0).all(), "negative terminal row")
        deg = a["child_ptr"][1:] - a["child_ptr"][:-1]
        need(int(deg.max()) == self.max_degree, f"max_degree {self.max_degree} != {int(deg.max())}")

