"""Slurm: host list expansion and the step's rendezvous (ahcomm._slurm)."""

from __future__ import annotations

import socket

import pytest

from ahcomm import ConfigError
from ahcomm._slurm import PORT_BASE, PORT_SPAN, expand_hostlist, port_for, rendezvous


@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("gpu-a[1-2]-ib,login1", ["gpu-a1-ib", "gpu-a2-ib", "login1"]),
    ("rack[1-2]n[01-02]", ["rack1n01", "rack1n02", "rack2n01", "rack2n02"]),
    ("a[009-011],b", ["a009", "a010", "a011", "b"]),
])
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[01-", "node]1[", "node[a-b]", "node[5-3]", ""])
def test_bad_hostlist_names_the_problem(spec: str) -> None:
    with pytest.raises(ConfigError, match="Slurm host list"):
        expand_hostlist(spec)


def test_port_depends_on_job_and_step() -> None:
    ports = {port_for(job, step) for job in range(1000, 1010) for step in range(3)}
    assert len(ports) == 30
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_rendezvous_of_a_step() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "localhost,node[2-3]"}
    assert rendezvous(env) == (socket.gethostbyname("localhost"), port_for(4242, 1))
    assert rendezvous({"SLURM_PROCID": "0"}) is None  # not a step: no job id or node list


def test_unresolvable_first_node_says_so() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "no-such-host-ahcomm[1-2].invalid"}
    with pytest.raises(ConfigError, match="does not resolve"):
        rendezvous(env)


def test_local_world_size_from_tasks_per_node() -> None:
    from ahcomm._slurm import expand_tasks_per_node, local_world_size

    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert local_world_size({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}) == 3
    assert local_world_size({"SLURM_STEP_TASKS_PER_NODE": "4"}) is None
    with pytest.raises(ConfigError, match="tasks per node"):
        expand_tasks_per_node("4(y2)")
