#!/bin/sh
# Make sure Debian's chromium is at /usr/bin/chromium (the status page's browser test drives it
# with playwright; playwright's own browser download cannot work here). Exit 0 when it is there.
set -e
[ -x /usr/bin/chromium ] && exit 0
export DEBIAN_FRONTEND=noninteractive
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium
[ -x /usr/bin/chromium ]
