"""The ``megatron-lns`` commands, one module each: its arguments and the glue that turns
them into calls of the library below.

Each module has ``add_parser(commands)``, which adds its subcommand to the command
line's subparsers and sets ``func`` to its ``run(args) -> int`` (the exit status).
``megatron_lns.cli`` lists the modules; a new command is a module here and a line there.
"""
