#!/bin/sh
# run from the workspace root
exec patch -p1 < "$(dirname "$0")/gold.patch"
