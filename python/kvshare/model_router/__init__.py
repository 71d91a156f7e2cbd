"""llama-server's router mode (`kvshare serve --models-dir DIR`, `--models-preset FILE.ini`,
`--models-max N`, `--[no-]models-autoload`): one process that lists several models, runs each
in a `kvshare serve` child started on demand, and passes each request on to the model it
names (docs/llama-server.md).

Modules: `cli` (router mode from the parsed flags: the children's command lines, startup),
`listing` (the models of --models-dir, the model store and the preset file, and their names),
`preset` (the preset .ini file), `child` (one model's process), `pool` (the models' status,
loading, unloading, --models-max), `app` (the HTTP endpoints and the proxying).

Not to be confused with kvshare.router (`kvshare route`), which spreads requests over replicas
of one model by their shared prefix."""
