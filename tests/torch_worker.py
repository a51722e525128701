"""A rank of the torch backend tests (tests/test_torch_backend.py): ``python torch_worker.py MODE``.

Modes: ``ops`` (every dist.* call against numpy, and against gloo where gloo has it), ``ddp`` and
``fsdp`` (print the trained weights and one process's), ``dead`` (rank 1 dies; rank 0 reports what wait() raised and
how long it took). Each check prints ``OK name``; a failed check raises (the rank exits 1).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import ahcomm.torch  # noqa: F401 - registers the backend

R = dist.ReduceOp


def inputs(r: int, shape: tuple[int, ...] = (6,), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank r's input: distinct, exactly representable values."""
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float64) % 7 + r * 3 + 1).reshape(shape).to(dtype)


def ok(name: str) -> None:
    print(f"OK {name}", flush=True)


def same(got: torch.Tensor, want: np.ndarray | torch.Tensor, name: str) -> None:
    want_t = want if isinstance(want, torch.Tensor) else torch.from_numpy(np.asarray(want))
    if not torch.equal(got.to(torch.float64), want_t.to(torch.float64).reshape(got.shape)):
        raise AssertionError(f"{name}: rank {dist.get_rank()} got {got} want {want_t}")


def check_all_reduce(n: int, me: int) -> None:
    every = [inputs(r).numpy().astype(np.float64) for r in range(n)]
    refs = {R.SUM: np.sum(every, 0), R.PRODUCT: np.prod(every, 0), R.MIN: np.min(every, 0),
            R.MAX: np.max(every, 0), R.AVG: np.mean(every, 0)}
    for op, want in refs.items():
        t = inputs(me)
        dist.all_reduce(t, op=op)
        same(t, want, f"all_reduce {op}")
    ints = [inputs(r, dtype=torch.int32).numpy() for r in range(n)]
    for op, fn in ((R.BAND, np.bitwise_and), (R.BOR, np.bitwise_or), (R.BXOR, np.bitwise_xor)):
        t = inputs(me, dtype=torch.int32)
        dist.all_reduce(t, op=op)
        same(t, fn.reduce(ints, 0), f"all_reduce {op}")
    for dtype in (torch.int64, torch.bfloat16, torch.float16, torch.float64, torch.uint8):
        t = inputs(me, dtype=dtype)
        dist.all_reduce(t)
        same(t, np.sum(every, 0), f"all_reduce sum {dtype}")
    # a strided (non-contiguous) tensor is reduced in place
    base = torch.stack([inputs(me), torch.full((6,), -1.0)], 1)
    col = base[:, 0]
    dist.all_reduce(col)
    same(base[:, 0], np.sum(every, 0), "all_reduce strided")
    same(base[:, 1], np.full(6, -1.0), "all_reduce strided leaves the rest")
    ok("all_reduce")


def check_async(n: int, me: int) -> None:
    t = inputs(me)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() is True
    assert work.is_completed() and work.is_success()
    value = work.get_future().wait()
    assert isinstance(value, list) and value[0] is t, value
    same(t, np.sum([inputs(r).numpy() for r in range(n)], 0), "async all_reduce")
    works = [dist.all_reduce(torch.full((3,), float(i + me)), async_op=True) for i in range(5)]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
    for i, f in enumerate(futs):
        same(f.wait(), np.full(3, 2.0 * sum(i + r for r in range(n))), "future chain")
    ok("async_op")


def check_gathers(n: int, me: int) -> None:
    x = inputs(me, (2, 3))
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        same(outs[r], inputs(r, (2, 3)), "all_gather")
    uneven = [torch.zeros(r + 1) for r in range(n)]  # rank r contributes r+1 elements
    dist.all_gather(uneven, inputs(me, (me + 1,)))
    for r in range(n):
        same(uneven[r], inputs(r, (r + 1,)), "all_gather uneven")
    flat = torch.zeros(n * 6)
    dist.all_gather_into_tensor(flat, x)
    same(flat, np.concatenate([inputs(r, (6,)).numpy() for r in range(n)]), "all_gather_into_tensor")
    stacked = torch.zeros(n, 2, 3)
    dist.all_gather_into_tensor(stacked, x)
    same(stacked, np.stack([inputs(r, (2, 3)).numpy() for r in range(n)]), "all_gather_into_tensor stacked")
    root = n - 1
    g = [torch.zeros(2, 3) for _ in range(n)] if me == root else None
    dist.gather(x, g, dst=root)
    if me == root:
        assert g is not None
        for r in range(n):
            same(g[r], inputs(r, (2, 3)), "gather")
    ok("all_gather gather")


def check_scatters(n: int, me: int) -> None:
    every = [inputs(r, (n * 4,)).numpy() for r in range(n)]
    total = np.sum(every, 0)
    y = torch.zeros(4)
    dist.reduce_scatter_tensor(y, inputs(me, (n * 4,)))
    same(y, total[me * 4:(me + 1) * 4], "reduce_scatter_tensor")
    y = torch.zeros(4)
    dist.reduce_scatter(y, list(inputs(me, (n * 4,)).chunk(n)), op=R.MAX)
    same(y, np.max(every, 0)[me * 4:(me + 1) * 4], "reduce_scatter max")
    root = n - 1
    s = torch.zeros(3)
    chunks = [torch.full((3,), 10.0 * r + 1) for r in range(n)] if me == root else None
    dist.scatter(s, chunks, src=root)
    same(s, np.full(3, 10.0 * me + 1), "scatter")
    b = inputs(me) if me == root else torch.zeros(6)
    dist.broadcast(b, src=root)
    same(b, inputs(root), "broadcast")
    red = inputs(me)
    dist.reduce(red, dst=root, op=R.SUM)
    if me == root:
        same(red, np.sum([inputs(r).numpy() for r in range(n)], 0), "reduce")
    ok("reduce_scatter scatter broadcast reduce")


def check_all_to_all(n: int, me: int) -> None:
    # all_to_all_single, even: block j of rank r is 100 r + j
    x = torch.tensor([100.0 * me + j for j in range(n) for _ in range(2)])
    y = torch.zeros(2 * n)
    dist.all_to_all_single(y, x)
    same(y, np.array([100.0 * r + me for r in range(n) for _ in range(2)]), "all_to_all_single")
    # uneven: rank r sends r + j + 1 rows of width 2 to rank j
    send = [me + j + 1 for j in range(n)]
    recv = [r + me + 1 for r in range(n)]
    x = torch.cat([torch.full((send[j], 2), 100.0 * me + j) for j in range(n)])
    y = torch.zeros(sum(recv), 2)
    dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=send)
    want = np.concatenate([np.full((recv[r], 2), 100.0 * r + me) for r in range(n)])
    same(y, want, "all_to_all_single uneven")
    outs = [torch.zeros(recv[r]) for r in range(n)]
    dist.all_to_all(outs, [torch.full((send[j],), 100.0 * me + j) for j in range(n)])
    for r in range(n):
        same(outs[r], np.full(recv[r], 100.0 * r + me), "all_to_all list")
    ok("all_to_all")


def check_p2p(n: int, me: int) -> None:
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = torch.zeros(5)
    if me % 2 == 0:
        dist.send(inputs(me, (5,)), nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(inputs(me, (5,)), nxt)
    same(got, inputs(prv, (5,)), "send/recv")
    got = torch.zeros(5)
    reqs = [dist.isend(inputs(me, (5,)), nxt, tag=3), dist.irecv(got, prv, tag=3)]
    for q in reqs:
        q.wait()
    same(got, inputs(prv, (5,)), "isend/irecv")
    got = torch.zeros(5)
    ops = [dist.P2POp(dist.irecv, got, prv), dist.P2POp(dist.isend, inputs(me, (5,)), nxt)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    same(got, inputs(prv, (5,)), "batch_isend_irecv")
    dist.barrier()
    ok("p2p barrier")


def check_objects(n: int, me: int) -> None:
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": me, "s": "x" * me})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(n)], objs
    lst: list[object] = [{"k": [1, 2]}, "two"] if me == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"k": [1, 2]}, "two"], lst
    g: list[object] | None = [None] * n if me == 0 else None
    dist.gather_object(("g", me), g, dst=0)
    if me == 0:
        assert g == [("g", r) for r in range(n)], g
    out: list[object] = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(n)] if me == 0 else None, src=0)
    assert out == [("s", me)], out
    ok("object collectives")


def check_groups(n: int, me: int) -> None:
    members = sorted({0, n - 1})
    sub = dist.new_group([n - 1, 0] if n > 1 else [0])  # with 3 ranks, rank 1 is not a member
    t = inputs(me)
    dist.all_reduce(t, group=sub)  # a no-op on non-members (torch's rule)
    same(t, np.sum([inputs(r).numpy() for r in members], 0) if me in members else inputs(me), "new_group all_reduce")
    if me in members:
        assert dist.get_world_size(sub) == len(members) and dist.get_rank(sub) == members.index(me)
    solo = [dist.new_group([r]) for r in range(n)][me]  # every rank calls new_group for every group
    t = inputs(me)
    dist.all_reduce(t, group=solo)
    same(t, inputs(me), "single-rank group")
    gloo = dist.new_group(list(range(n)), backend="gloo")
    for op in (R.SUM, R.MAX):
        a, b = inputs(me, (4, 5)), inputs(me, (4, 5))
        dist.all_reduce(a, op=op)
        dist.all_reduce(b, op=op, group=gloo)
        same(a, b, f"all_reduce {op} vs gloo")
    send = [me + j + 1 for j in range(n)]
    recv = [r + me + 1 for r in range(n)]
    x = torch.cat([torch.full((send[j],), 100.0 * me + j) for j in range(n)])
    a, b = torch.zeros(sum(recv)), torch.zeros(sum(recv))
    dist.all_to_all_single(a, x, recv, send)
    dist.all_to_all_single(b, x, recv, send, group=gloo)
    same(a, b, "all_to_all_single uneven vs gloo")
    ok("new_group")


def check_errors(n: int, me: int) -> None:
    try:
        dist.reduce_scatter_tensor(torch.zeros(3), torch.zeros(n * 4))
    except ValueError as exc:
        assert "reduce_scatter_tensor" in str(exc), exc
    else:
        raise AssertionError("a wrong output size was accepted")
    try:
        dist.all_reduce(torch.zeros(2), op=R.BAND)  # bitwise on floats
    except TypeError as exc:
        assert "band" in str(exc).lower(), exc
    else:
        raise AssertionError("band on float32 was accepted")
    t = inputs(me)
    dist.all_reduce(t)  # the group still works after refused calls
    same(t, np.sum([inputs(r).numpy() for r in range(n)], 0), "after errors")
    ok("errors")


def ops() -> None:
    dist.init_process_group("ahcomm")
    n, me = dist.get_world_size(), dist.get_rank()
    assert dist.get_backend() == "ahcomm", dist.get_backend()
    for check in (check_all_reduce, check_async, check_gathers, check_scatters, check_all_to_all, check_p2p,
                  check_objects, check_groups, check_errors):
        check(n, me)
    dist.destroy_process_group()
    ok("destroy")


def ddp() -> None:
    """A small model trained with DDP (``ddp``) or FSDP2 (``fsdp``) on this rank's shard; rank 0
    prints the final weights and those of one process trained on the whole batch."""
    dist.init_process_group("ahcomm")
    n, me = dist.get_world_size(), dist.get_rank()
    model = train(n, me, wrap=sys.argv[1])
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    if me == 0:
        reference = list(train(n, 0, wrap="").parameters())  # one process, the whole batch
        for name, ps in (("WEIGHTS", weights), ("REFERENCE", reference)):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            print(f"{name} " + " ".join(f"{v:.9g}" for v in flat.tolist()), flush=True)
    dist.destroy_process_group()


def train(n: int, me: int, *, wrap: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    net: torch.nn.Module = model
    if wrap == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)  # several buckets
    elif wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
    distributed = bool(wrap)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(8 * n, 8, generator=data)
        y = x.sum(1, keepdim=True)
        shard = slice(me * 8, (me + 1) * 8) if distributed else slice(None)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[shard]), y[shard]).backward()
        opt.step()
    return model


def dead() -> None:
    """Rank 1 exits mid-job; rank 0's next collective must raise from wait(), not hang."""
    dist.init_process_group("ahcomm")
    me = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    if me == 1:
        os._exit(0)  # a clean exit: the launcher leaves rank 0 running
    time.sleep(0.5)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16), async_op=True).wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"RAISED {type(exc).__name__} (cause {type(exc.__cause__).__name__}) after "
              f"{time.monotonic() - start:.1f} s: {exc}"[:400], flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(1)


def timeout() -> None:
    """Rank 1 never joins the second all_reduce; rank 0's wait() must raise once the group's
    timeout (5 s) has passed."""
    import datetime

    dist.init_process_group("ahcomm", timeout=datetime.timedelta(seconds=5))
    me = dist.get_rank()
    dist.all_reduce(torch.ones(4))
    if me == 1:
        time.sleep(12)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"RAISED {type(exc).__name__} TimeoutError={isinstance(exc, TimeoutError)} after "
              f"{time.monotonic() - start:.1f} s: {exc}"[:400], flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(1)


if __name__ == "__main__":
    {"ops": ops, "ddp": ddp, "fsdp": ddp, "dead": dead, "timeout": timeout}[sys.argv[1]]()
