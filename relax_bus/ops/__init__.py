"""The operations around the bus's loop: the `relax` commands of the bus (`cli`, `cli_server`, `arguments`),
the embedded nats-server and its config files (`server`, `server_conf`), the run's NATS users (`auth`,
`credentials`), `relax inspect` (`run_report`), `relax decode` (`message_json`) and `--version` (`about`).

The loop (connection, bus, topology, provision, publisher, workers, versions) never imports this package;
it imports the loop.
"""
