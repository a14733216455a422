"""What an option given to sbatch or srun means: the long option it abbreviates.

sbatch and srun read options with getopt_long, which accepts any unambiguous prefix of
a long option (``--no-req`` is ``--no-requeue``, ``--sig=`` is ``--signal=``); an exact
name wins over longer ones (``--mem`` is not ambiguous with ``--mem-per-cpu``). The
conflict check of the batch script (``render.py``) must therefore see the full name.

The lists are the complete getopt tables of the packaged SLURM, 22.05.8 (Debian 12's
``slurm-client``), hidden options included: the names ``sbatch --help`` / ``srun
--help`` print, plus every candidate getopt lists for ``sbatch --a`` ... ``--z``
("option '--n' is ambiguous; possibilities: ...", which also names options --help
leaves out, such as ``--tasks-per-node``, ``--kill-on-invalid-dep``, ``--x11``).
srun's table also has the options of the pyxis SPANK plugin (NVIDIA/pyxis ``args.c``),
which are long options of srun on any cluster that runs containers.

Other SLURM versions add and remove a few options. A name this list does not know is
left to SLURM; a prefix that is ambiguous here but could mean a managed option is
refused, so a version without the other candidates cannot turn it into that option.
"""

from __future__ import annotations


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


SBATCH_LONG_OPTIONS = _names(
    """
    account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint
    clusters comment constraint container context contiguous core-spec
    cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot
    dependency distribution error exclude exclusive export export-file
    extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node
    gpus-per-socket gpus-per-task gres gres-flags help hint hold ignore-pbs input
    job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind
    mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile
    nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node
    ntasks-per-socket ntasks-per-tres open-mode output overcommit oversubscribe
    parsable partition power prefer priority profile propagate qos quiet reboot
    requeue reservation signal sockets-per-node spread-job switches tasks-per-node
    test-only thread-spec threads-per-core time time-min tmp uid usage use-min-nodes
    verbose version wait wait-all-nodes wckey wrap
    """
)

PYXIS_LONG_OPTIONS = _names(
    """
    container-image container-mounts container-workdir container-name container-save
    container-mount-home no-container-mount-home container-remap-root
    no-container-remap-root container-entrypoint no-container-entrypoint
    container-entrypoint-log container-writable container-readonly container-env
    """
)

SRUN_LONG_OPTIONS = PYXIS_LONG_OPTIONS | _names(
    """
    accel-bind account acctg-freq bb bbf bcast bcast-exclude begin chdir cluster
    cluster-constraint clusters comment compress constraint container context
    contiguous core-spec cores-per-socket cpu-bind cpu-freq cpu_bind cpus-per-gpu
    cpus-per-task deadline debugger-test delay-boot dependency disable-status
    distribution epilog error exact exclude exclusive export extra-node-info gid
    gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres
    gres-flags help het-group hint hold immediate input interactive job-name jobid
    kill-on-bad-exit label licenses mail-type mail-user mcs-label mem mem-bind
    mem-per-cpu mem-per-gpu mincpus mpi msg-timeout multi-prog network nice
    no-allocate no-kill nodefile nodelist nodes ntasks ntasks-per-core
    ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode
    output overcommit overlap oversubscribe pack-group partition power prefer
    preserve-env priority profile prolog propagate pty qos quiet quit-on-interrupt
    reboot relative reservation resv-ports send-libs signal slurmd-debug
    sockets-per-node spread-job switches task-epilog task-prolog tasks-per-node
    test-only thread-spec threads threads-per-core time time-min tmp uid unbuffered
    usage use-min-nodes verbose version wait wckey whole x11
    """
)


# The short options, as getopt's option string spells them ("x:" takes an argument,
# "x::" an optional one, attached), read off the same binaries (``sbatch -x`` for each
# letter: "invalid option", "requires an argument", or a flag).
SBATCH_SHORT_OPTIONS = "A:B:C:D:F:G:HJ:L:M:N:OQS:VWa:b:c:d:e:hi:k::m:n:o:p:q:st:vw:x:"
SRUN_SHORT_OPTIONS = "A:B:C:D:EF:G:HI::J:K::L:M:N:OQS:T:VW:XZb:c:d:e:hi:k::lm:n:o:p:q:r:st:uvw:x:"


def option_names(arg: str, short_options: str) -> list[str]:
    """The options an argument gives, as written: ``--sig`` of ``--sig=B:USR1@60``;
    ``-p`` of ``-pgpu``; ``-Q``, ``-v`` and ``-N`` of ``-QvN2``: getopt reads a group of
    short options up to the first that takes an argument, which takes the rest. A
    letter ``short_options`` does not know is read as a flag (SLURM refuses it)."""
    if arg.startswith("--"):
        return [arg.split("=", 1)[0]]
    if not arg.startswith("-"):
        return []
    names = []
    for letter in arg[1:]:
        names.append(f"-{letter}")
        at = short_options.find(letter) if letter != ":" else -1
        if at >= 0 and short_options[at + 1 : at + 2] == ":":
            break
    return names


def long_option_meanings(name: str, known: frozenset[str]) -> list[str]:
    """The long options ``name`` (``--xyz``) can mean to getopt_long, sorted:
    one for an exact name or an unambiguous prefix, several for an ambiguous prefix,
    none for a name ``known`` does not have."""
    bare = name[2:]
    if bare in known:
        return [name]
    return sorted(f"--{option}" for option in known if option.startswith(bare))
