#!/bin/sh
# Packs the build to compare against (a commit, default main's first parent) into .ab/base.tar.gz, an ignored
# folder the device run carries: `sh dev/ab/prepare.sh <commit>`, then on the GPU machine, in one call with
# carry [".ab"]: `bash dev/ab/phase1.sh && bash dev/ab/phase2.sh`.
set -eu
base=${1:-HEAD^}
mkdir -p .ab
git archive --format=tar.gz -o .ab/base.tar.gz "$base"
git rev-parse "$base" > .ab/base.commit
echo "base $(cat .ab/base.commit) in .ab/base.tar.gz"
