#!/bin/sh
# The PostgreSQL stand-in's entry point: initialise an empty data volume as the official image does
# (superuser POSTGRES_USER with POSTGRES_PASSWORD, database POSTGRES_DB, password logins from the
# network), then run the server in the foreground, so that compose's restart policy sees it die.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  "$bin/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    "$bin/createdb" -U "$POSTGRES_USER" "$POSTGRES_DB"
    "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
  fi
  echo "postgres: initialised $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*'
