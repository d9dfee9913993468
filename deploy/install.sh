#!/usr/bin/env bash
# Install the primerl systemd units on this node: the system user, /etc/primerl with an environment file and
# example configs (never overwriting what is there), the state and cache directories, the units, and
# `systemctl daemon-reload`. Run it again after an upgrade: units are refreshed, edited files are kept.
#
#   sudo deploy/install.sh                                  # primerl installed in /opt/primerl/.venv
#   sudo deploy/install.sh --venv /srv/primerl/.venv --infer-workers 4
#   deploy/install.sh --root /tmp/node-root                 # into a directory (an image, a test): no user, no chown,
#                                                           # no daemon-reload
set -euo pipefail

usage() {
    cat <<'EOF'
usage: install.sh [--root DIR] [--venv DIR] [--env-venv DIR] [--user NAME] [--infer-workers N] [--token TOKEN]
                  [--no-reload]

  --root DIR         install under DIR instead of / (no user is created, no owner changed, no daemon-reload)
  --venv DIR         the virtual environment primerl is installed in (default /opt/primerl/.venv)
  --env-venv DIR     the env workers' environment (verifiers; default /opt/primerl/.venv-envs)
  --user NAME        the system user the daemons run as (default primerl)
  --infer-workers N  write /etc/primerl/infer/0.env .. N-1.env for primerl-infer@0 .. @N-1 (ports 8000+i,
                     CUDA_VISIBLE_DEVICES=i), each only if missing
  --token TOKEN      the run token for a new /etc/primerl/primerl.env (default: the one in
                     /etc/primerl/run-token.env, else a fresh random one); an existing primerl.env is kept
  --no-reload        do not run `systemctl daemon-reload`
EOF
}

ROOT=""
VENV=/opt/primerl/.venv
ENV_VENV=/opt/primerl/.venv-envs
USER_NAME=primerl
INFER_WORKERS=0
TOKEN=""
RELOAD=1

need_value() {
    [[ $# -ge 2 && -n "$2" ]] || { echo "install.sh: $1 needs a value (see --help)" >&2; exit 2; }
}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --root) need_value "$@"; ROOT="${2%/}"; shift 2 ;;
        --venv) need_value "$@"; VENV="${2%/}"; shift 2 ;;
        --env-venv) need_value "$@"; ENV_VENV="${2%/}"; shift 2 ;;
        --user) need_value "$@"; USER_NAME="$2"; shift 2 ;;
        --infer-workers) need_value "$@"; INFER_WORKERS="$2"; shift 2 ;;
        --token) need_value "$@"; TOKEN="$2"; shift 2 ;;
        --no-reload) RELOAD=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$INFER_WORKERS" =~ ^[0-9]+$ ]] || { echo "install.sh: --infer-workers takes a number, got $INFER_WORKERS" >&2; exit 2; }
[[ "$VENV" == /* && "$ENV_VENV" == /* ]] || { echo "install.sh: --venv and --env-venv take absolute paths" >&2; exit 2; }
[[ ! "$VENV$ENV_VENV" =~ [[:space:]%\$] ]] || { echo "install.sh: --venv and --env-venv cannot hold spaces, % or \$ (unit command lines)" >&2; exit 2; }
[[ "$USER_NAME" =~ ^[a-z_][a-z0-9_-]*$ ]] || { echo "install.sh: --user $USER_NAME is not a valid user name" >&2; exit 2; }
if [[ -n "$ROOT" ]]; then
    mkdir -p "$ROOT"
    ROOT="$(cd "$ROOT" && pwd)"
elif [[ "$(id -u)" != 0 ]]; then
    echo "install.sh: run it as root (sudo), or with --root DIR to install into a directory" >&2
    exit 1
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
UNIT_DIR="$ROOT/etc/systemd/system"
CONF_DIR="$ROOT/etc/primerl"
say() { printf '  %s\n' "$*"; }

# A directory with its mode, and its owner on a real system (`install -d` is idempotent).
make_dir() {  # MODE OWNER:GROUP DIR
    if [[ -z "$ROOT" ]]; then
        install -d -m "$1" -o "${2%%:*}" -g "${2##*:}" "$3"
    else
        install -d -m "$1" "$3"
    fi
}

# A file written only when missing: what an operator edited stays.
install_once() {  # MODE OWNER:GROUP DEST (content on stdin)
    local mode="$1" owner="$2" dest="$3"
    if [[ -e "$dest" ]]; then
        cat >/dev/null
        say "kept     ${dest#"$ROOT"} (exists)"
        return
    fi
    local tmp
    tmp="$(mktemp "$dest.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    [[ -n "$ROOT" ]] || chown "$owner" "$tmp"
    mv "$tmp" "$dest"
    say "wrote    ${dest#"$ROOT"}"
}

# A file that install.sh owns (units, examples): replaced when its content changed.
install_ours() {  # MODE DEST (content on stdin)
    local mode="$1" dest="$2" tmp
    tmp="$(mktemp "$dest.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -e "$dest" ]] && cmp -s "$tmp" "$dest"; then
        rm -f "$tmp"
        say "same     ${dest#"$ROOT"}"
    else
        local verb="wrote   "
        [[ -e "$dest" ]] && verb="updated "
        mv "$tmp" "$dest"
        say "$verb ${dest#"$ROOT"}"
    fi
}

sed_escape() { printf '%s' "$1" | sed 's/[\\|&]/\\&/g'; }
# The units as shipped name /opt/primerl/.venv and .venv-envs and the user primerl: this node's instead.
render() {  # FILE
    sed -e "s|/opt/primerl/\.venv-envs/|$(sed_escape "$ENV_VENV")/|g" \
        -e "s|/opt/primerl/\.venv/|$(sed_escape "$VENV")/|g" \
        -e "s|^User=primerl\$|User=$USER_NAME|" -e "s|^Group=primerl\$|Group=$USER_NAME|" "$1"
}

echo "primerl: installing into ${ROOT:-/}"

echo "user"
if [[ -n "$ROOT" ]]; then
    say "skipped  system user $USER_NAME (--root: create it on the target system)"
elif getent passwd "$USER_NAME" >/dev/null; then
    say "exists   $USER_NAME"
else
    useradd --system --user-group --home-dir /var/lib/primerl --no-create-home \
        --shell /usr/sbin/nologin --comment "primerl daemons" "$USER_NAME"
    say "created  system user $USER_NAME (home /var/lib/primerl)"
fi

echo "directories"
make_dir 0755 root:root "$ROOT/etc/systemd/system"
make_dir 0750 "root:$USER_NAME" "$CONF_DIR"
make_dir 0750 "root:$USER_NAME" "$CONF_DIR/infer"
make_dir 0750 "root:$USER_NAME" "$CONF_DIR/certs"
make_dir 0755 root:root "$CONF_DIR/examples"
make_dir 0750 "$USER_NAME:$USER_NAME" "$ROOT/var/lib/primerl"
make_dir 0750 "$USER_NAME:$USER_NAME" "$ROOT/var/cache/primerl"
say "ok       /etc/primerl{,/infer,/certs,/examples} /var/lib/primerl /var/cache/primerl"
if [[ -z "$ROOT" ]]; then  # credentials copied in from `primerl certs` (owner-only): readable by the daemons' group
    chgrp -R "$USER_NAME" "$CONF_DIR/certs" && chmod -R g+rX,g-w,o-rwx "$CONF_DIR/certs"
    say "ok       /etc/primerl/certs: group $USER_NAME may read, others nothing"
fi

echo "units"
for unit in "$HERE"/systemd/*.service "$HERE"/systemd/*.target; do
    render "$unit" | install_ours 0644 "$UNIT_DIR/$(basename "$unit")"
done

echo "configuration"
if [[ -z "$TOKEN" && -r "$CONF_DIR/run-token.env" ]]; then  # the file the units of earlier releases read
    TOKEN="$(sed -n 's/^PRIMERL_RUN_TOKEN=//p' "$CONF_DIR/run-token.env" | tail -n 1)"
fi
if [[ -z "$TOKEN" && ! -e "$CONF_DIR/primerl.env" ]]; then
    TOKEN="$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
fi
sed "s|^PRIMERL_RUN_TOKEN=\$|PRIMERL_RUN_TOKEN=$(sed_escape "$TOKEN")|" "$HERE/etc/primerl.env" \
    | install_once 0640 "root:$USER_NAME" "$CONF_DIR/primerl.env"
for role in broker trainer orchestrator inference; do
    install_once 0640 "root:$USER_NAME" "$CONF_DIR/$role.toml" <"$HERE/etc/$role.toml"
done
for ((i = 0; i < INFER_WORKERS; i++)); do
    sed -e "s|@NAME@|$i|g" -e "s|@PORT@|$((8000 + i))|" -e "s|@DEVICE@|$i|" "$HERE/etc/infer-instance.env" \
        | install_once 0640 "root:$USER_NAME" "$CONF_DIR/infer/$i.env"
done
for example in "$HERE"/etc/* "$HERE/README.md"; do
    render "$example" | install_ours 0644 "$CONF_DIR/examples/$(basename "$example")"
done

echo "checks"
for command in primerl-broker primerl-trainer primerl-orchestrator primerl-infer; do
    if [[ ! -x "$VENV/bin/$command" && ! -x "$ROOT$VENV/bin/$command" ]]; then
        say "WARNING  $VENV/bin/$command is missing: install primerl there (pip install /path/to/primerl), or pass --venv"
    fi
done
interpreter="$(readlink -f "$ROOT$VENV/bin/python" 2>/dev/null || true)"
[[ -e "$interpreter" ]] || interpreter="$(readlink -f "$VENV/bin/python" 2>/dev/null || true)"
if [[ "$interpreter" == /root/* || "$interpreter" == /home/* ]]; then
    say "WARNING  $VENV/bin/python is $interpreter: the units cannot reach it (ProtectHome=true, and a home is" \
        "not the daemons' to read); make the venv from a Python outside /root and /home (e.g. uv python install" \
        "--install-dir /opt/python, or the system's python3)"
fi
if [[ "$RELOAD" == 1 && -z "$ROOT" && -d /run/systemd/system ]]; then
    systemctl daemon-reload
    say "ran      systemctl daemon-reload"
elif [[ "$RELOAD" == 1 && -z "$ROOT" ]]; then
    say "skipped  systemctl daemon-reload (systemd is not running here)"
else
    say "skipped  systemctl daemon-reload"
fi

cat <<EOF

Next, on this node:
  1. /etc/primerl/primerl.env: the run token (the same on every node: copy this file's PRIMERL_RUN_TOKEN line to
     the others), wire-security files, extra settings per role.
  2. /etc/primerl/<role>.toml for the roles this node runs (from \`primerl rl @ run.toml --broker.host 0.0.0.0
     --broker.run-token TOKEN --dry-run --write DIR\`, without its run_token lines: the units take it from
     primerl.env); set broker.address = "<broker node>:50051" in every role but the broker.
  3. Inference workers: /etc/primerl/infer/NAME.env per worker (port, devices; --infer-workers N writes 0..N-1).
  4. Enable this node's roles into primerl.target and start it, e.g.
       systemctl enable primerl.target primerl-broker.service primerl-orchestrator.service
       systemctl enable primerl.target primerl-infer@0.service primerl-infer@1.service
       systemctl start primerl.target
     then: journalctl -u 'primerl-*' -f ; primerl status --broker <broker node>:50051
EOF
