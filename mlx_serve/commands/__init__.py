"""CLI subcommands; see mlx_serve.cli for the contract each module follows."""
