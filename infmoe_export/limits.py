"""Sizes checked before anything is allocated, so that a hostile config, file or flag gets a
one-line refusal instead of taking the machine down."""

import os
import resource

from .errors import InfMoEError

MAX_CONFIG_BYTES = 1 << 20      # a config.json is a few hundred bytes
MAX_TEXT_BYTES = 1 << 28        # text to train on or score: 256 MiB (the stdlib corpus is ~30 MiB)
# Share of the memory available now that one command may plan to use.
USABLE_SHARE = 0.8


# A cap the user sets for a shared machine or CI (GiB, e.g. INFMOE_MAX_MEMORY_GIB=2).
CAP_VARIABLE = "INFMOE_MAX_MEMORY_GIB"


def _process_bytes(virtual: bool) -> int:
    """This process's address space (virtual) or resident memory now: what a limit on the whole
    process has already spent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0 if virtual else 1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_bytes() -> int:
    """The memory a command may plan with: MemAvailable from /proc/meminfo (else the physical
    memory), lowered by the process's address-space limit and by $INFMOE_MAX_MEMORY_GIB. Both
    bound the whole process, so what it holds already (libraries, the model) is taken off them."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        available = min(available, limit - _process_bytes(virtual=True))
    cap = os.environ.get(CAP_VARIABLE)
    if cap:
        try:
            available = min(available, int(float(cap) * 2**30) - _process_bytes(virtual=False))
        except ValueError:
            raise InfMoEError(f"${CAP_VARIABLE} must be a number of GiB, got {cap!r}") from None
    return max(available, 0)


def check_fits(nbytes: int, what: str) -> None:
    """Refuse when nbytes exceeds the usable share of the memory available now."""
    usable = int(available_bytes() * USABLE_SHARE)
    if nbytes > usable:
        raise InfMoEError(f"{what} needs about {nbytes / 2**30:.3g} GiB, more than the {usable / 2**30:.3g} GiB "
                          "of memory available")


def check_file_size(path, limit: int, what: str) -> int:
    """The file's size, refused above limit (before reading it: a huge or sparse file)."""
    size = os.stat(path).st_size
    if size > limit:
        raise InfMoEError(f"{what} {path} is {size / 2**20:.3g} MiB, more than the {limit / 2**20:.3g} MiB accepted")
    return size


def forward_bytes(config, batch: int, seq: int, k: int) -> int:
    """A generous estimate of one reference forward's working memory (float32): per token the
    K starts, noise, router outputs and their temporaries (measured: about 35 bytes per window),
    the H-wide coverage and hidden activations, the logits, the residual stream, and the whole
    KV cache."""
    per_token = 48 * k + 16 * config.ffn_hidden + 8 * config.vocab_size + 64 * config.d_model
    cache = 8 * config.n_layer * config.d_model
    return batch * seq * (per_token + cache)
