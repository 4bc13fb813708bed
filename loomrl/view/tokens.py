"""TokenText: token ids as the text pieces the run's tokenizer gives them, for the trajectory viewer; and
`token_gaps`, a train record's logprob gaps laid on a context's tokens (the page's `gap` colouring).

The tokenizer is the one the run saved with its checkpoints (RUN/checkpoints/<step>/model), else the one its
config.yaml names (model.kind tiny / smollm2 / gguf / hf: loomrl/model/loader.py), loaded once per run on first use
in a thread of its own. When neither can be loaded (a run folder copied without its checkpoints, a model not on this
machine) the viewer shows the ids and says why: `reason`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from loomrl.run_folder import RunFolder

log = logging.getLogger("loomrl.view")
# One load at a time in this process: two threads importing transformers at once (the page opens several runs and
# each starts its tokenizer) can see its lazy module half-initialised ("cannot import name 'AutoTokenizer'").
_LOAD_LOCK = threading.Lock()


def token_gaps(loss_mask: list[int], gaps: list[float] | None) -> list[float | None] | None:
    """Per token of a context, its recorded |trainer - engine| logprob gap (None where not trained), or None without
    a record. The record has one gap per loss-masked token t >= 1 in order (trainer/tree.py sampled_positions: the
    first token has no position to be predicted from); a record that does not fit the context is not shown."""
    if gaps is None:
        return None
    trained = [t for t in range(1, len(loss_mask)) if loss_mask[t]]
    if len(trained) != len(gaps):
        log.warning("a train record has %d gaps for a context with %d trained tokens; not shown", len(gaps),
                    len(trained))
        return None
    out: list[float | None] = [None] * len(loss_mask)
    for t, g in zip(trained, gaps):
        out[t] = g
    return out


class TokenText:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        self.run_dir = run_dir
        self.config = config
        self.reason = ""  # why there is no tokenizer, once loading failed
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._tried = False
        self._loaded = threading.Event()

    def _load(self) -> Any:
        from transformers import AutoTokenizer

        folder = RunFolder(self.run_dir)
        saved = [c.model for c in folder.saved_checkpoints() if (c.model / "tokenizer_config.json").is_file()]
        if saved:
            return AutoTokenizer.from_pretrained(saved[-1])
        from loomrl.config import load_config
        from loomrl.model.loader import load_tokenizer

        return load_tokenizer(load_config(str(folder.config), []).model)

    def tokenizer(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    with _LOAD_LOCK:
                        self._tokenizer = self._load()
                except Exception as err:  # any loader failure leaves the viewer usable, with ids
                    self.reason = f"no tokenizer for {self.run_dir.name} ({type(err).__name__}: {err}); showing ids"
                    log.warning("%s", self.reason)
                self._loaded.set()
            return self._tokenizer

    def warm(self) -> None:
        """Load the tokenizer in the background (importing transformers takes seconds), before a trajectory asks."""
        if not self._tried:
            threading.Thread(target=self.tokenizer, name="loomrl-view-tokenizer", daemon=True).start()

    def loaded(self, wait_s: float) -> bool:
        """Whether the tokenizer has been loaded (or has failed to), waiting at most `wait_s` for a load under way:
        a trajectory opened while it loads answers with ids at once rather than after the seconds transformers
        takes to import (the page asks again)."""
        self.warm()
        return self._loaded.wait(wait_s)

    def pieces(self, ids: list[int]) -> list[str] | None:
        """Each id's own text (byte-level pieces decoded one by one), or None without a tokenizer."""
        tok = self.tokenizer()
        if tok is None:
            return None
        return [tok.decode([i]) for i in ids]
