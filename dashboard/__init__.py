"""The run dashboard (`primerl dashboard`): a read-only web page of a run, live.

- ``server``: the HTTP server (login token, read-only routes, strict CSP) and its JSON API;
- ``sources``: what it reads: a run directory's files and/or a broker's status and run history over gRPC;
- ``charts``: the step metrics each chart draws, named by ``primerl.proto.telemetry``'s keys (``/api/charts``);
- ``static/``: the page (HTML, JS, CSS; no asset from the internet).
"""
