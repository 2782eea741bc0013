#!/bin/sh
# The explorer's browser tests (tests/e2e/test_scope_browser.py) drive Debian's Chromium through
# its ChromeDriver: install both when missing (apt, as root or through sudo). Nothing else is
# downloaded at test time (Selenium is told to stay offline).
set -e
command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }
