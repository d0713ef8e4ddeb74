"""The world a torchrun script meets on a dtlab rank: torchrun's, with the group made.

While a script runs (``install(notes)`` .. ``uninstall()``):

- ``init_process_group(...)`` returns dtlab's group when what it asks for agrees with it
  (backend, world size, rank) and says so once in ``notes``; otherwise a ScriptWorldError
  names what differs. Patched in ``torch.distributed`` and ``distributed_c10d`` before the
  script runs, so ``from torch.distributed import init_process_group`` binds the wrapper;
- ``destroy_process_group()`` of the default group leaves it alive (the next job needs
  it; destroying and re-creating a group on the same store hangs, PyTorch #55967);
- ``torch.multiprocessing.spawn`` / ``start_processes`` are refused: each rank is already
  one process, as under torchrun;
- ``atexit.register`` of a function of the script's own folder runs it when the script
  ends (under torchrun the process ends with it; the engine lives on). Libraries' own
  hooks stay process hooks;
- ``multiprocessing.set_start_method(m)`` asked again with what is set already is a
  no-op, and another method is forced: the engine outlives the run that first set it;
  the engine's own method comes back when the script ends.

The wrappers call the originals when no script runs, so modules that bound them stay
correct afterwards.
"""

from __future__ import annotations

from dtlab.agent.state import RANK


class ScriptWorldError(RuntimeError):
    """The script asks for a process group other than the ranks'."""


def install(notes: list[str], folder: str = "") -> None:
    import atexit
    import multiprocessing

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing as tmp

    RANK.script_notes = notes
    RANK.script_said = set()
    RANK.script_exits = []
    RANK.script_folder = folder
    RANK.script_start_method = multiprocessing.get_start_method(allow_none=True)
    if RANK.script_env_patched is not None:
        return
    atexit.register = _atexit_wrapper(atexit.register)
    start_method = _start_method_wrapper(multiprocessing.set_start_method)
    multiprocessing.set_start_method = tmp.set_start_method = start_method
    originals = {
        "init": c10d.init_process_group,
        "destroy": c10d.destroy_process_group,
        "spawn": tmp.spawn,
        "start_processes": tmp.start_processes,
    }
    RANK.script_env_patched = originals
    init = _init_wrapper(originals["init"])
    destroy = _destroy_wrapper(originals["destroy"])
    for owner in (dist, c10d):
        owner.init_process_group = init
        owner.destroy_process_group = destroy
    tmp.spawn = _refuse_spawn(originals["spawn"], "torch.multiprocessing.spawn")
    tmp.start_processes = _refuse_spawn(originals["start_processes"], "start_processes")


def uninstall() -> None:
    """The script is over: the engine's start method back (the next job expects it)."""
    import multiprocessing

    before = RANK.script_start_method
    RANK.script_notes = RANK.script_start_method = None
    if multiprocessing.get_start_method(allow_none=True) != before:
        multiprocessing.set_start_method(before, force=True)


def run_exit_handlers() -> list[str]:
    """The script's own atexit functions, last registered first (as at a process's end);
    -> what each that raised said."""
    said = []
    exits, RANK.script_exits = RANK.script_exits, []
    for func, args, kwargs in reversed(exits):
        try:
            func(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported, as Python reports them
            said.append(
                f"the script's atexit function {getattr(func, '__name__', func)} "
                f"raised {type(e).__name__}: {e}"
            )
    return said


def _own(func) -> bool:
    code = getattr(func, "__code__", None)
    folder = RANK.script_folder
    return bool(folder and code and code.co_filename.startswith(folder))


def _atexit_wrapper(original):
    def register(func, *args, **kwargs):
        if active() and _own(func):
            RANK.script_exits.append((func, args, kwargs))
            return func
        return original(func, *args, **kwargs)

    register.__wrapped__ = original
    return register


def _start_method_wrapper(original):
    def set_start_method(method, force=False):
        import multiprocessing

        if active() and not force:
            if multiprocessing.get_start_method(allow_none=True) == method:
                return None
            return original(method, force=True)
        return original(method, force)

    set_start_method.__wrapped__ = original
    return set_start_method


def active() -> bool:
    return RANK.script_notes is not None


def _note_once(key: str, text: str) -> None:
    if key not in RANK.script_said:
        RANK.script_said.add(key)
        RANK.script_notes.append(text)


def _asked_backends(backend) -> set[str]:
    """``"nccl"`` -> {"nccl"}; ``"cpu:gloo,cuda:nccl"`` -> {"gloo", "nccl"}; None -> {}."""
    if backend is None:
        return set()
    names = set()
    for part in str(backend).lower().split(","):
        names.add(part.split(":")[-1].strip())
    return names - {""}


def _init_wrapper(original):
    def init_process_group(
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
        **kwargs,
    ):
        if not active():
            return original(
                backend,
                init_method,
                timeout,
                world_size,
                rank,
                store,
                group_name,
                pg_options,
                device_id,
                **kwargs,
            )
        import torch.distributed as dist

        have, size, me = dist.get_backend(), dist.get_world_size(), dist.get_rank()
        problems = []
        asked = _asked_backends(backend)
        if asked and have not in asked:
            problems.append(f"backend {backend!r}, but these ranks run {have!r}")
        if world_size not in (-1, None) and int(world_size) != size:
            problems.append(f"world_size={world_size}, but there are {size} ranks")
        if rank not in (-1, None) and int(rank) != me:
            problems.append(f"rank={rank} on rank {me}")
        if problems:
            fix = (
                f"relaunch with %dt_launch {world_size} --backend {sorted(asked)[0]}"
                if asked and world_size not in (-1, None)
                else f"relaunch with %dt_launch {size} --backend {sorted(asked)[0]}"
                if asked and have not in asked
                else "make the script read WORLD_SIZE and RANK from the environment"
            )
            raise ScriptWorldError(
                f"the script's init_process_group asks for {'; '.join(problems)}: {fix} "
                "(dtlab's ranks are the process group; they cannot become another one)"
            )
        _note_once(
            "init",
            f"init_process_group(backend={backend!r}) uses dtlab's group "
            f"({size} ranks, {have}); it was not created again",
        )
        return None

    init_process_group.__wrapped__ = original
    return init_process_group


def _destroy_wrapper(original):
    def destroy_process_group(group=None):
        import torch.distributed as dist

        if not active() or (group is not None and group is not dist.group.WORLD):
            return original(group)
        _note_once("destroy", "destroy_process_group() left dtlab's group alive for the next job")
        return None

    destroy_process_group.__wrapped__ = original
    return destroy_process_group


def _refuse_spawn(original, name: str):
    def refuse(*args, **kwargs):
        if not active():
            return original(*args, **kwargs)
        raise ScriptWorldError(
            f"the script starts its own worker processes ({name}): on dtlab, as under "
            "torchrun, each rank is already one process. Call the worker function directly "
            "when RANK is set, e.g. `if 'RANK' in os.environ: main(int(os.environ['RANK'])) "
            "else: mp.spawn(main, nprocs=n)`"
        )

    refuse.__wrapped__ = original
    return refuse
