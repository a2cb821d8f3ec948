# Fetches the runtime dependencies of a pom from Maven Central into
# HOME/libs, once per pom content (HOME/.fetched holds the pom's digest, so
# a changed pom fetches again). Tests start several JVMs at once: one
# fetches under HOME/.lock, the others wait and find the stamp.
#
#   maven_fetch WHO WHAT POM HOME M2 EXPECTED_JAR
#
# WHO prefixes the messages (kafka.sh), WHAT names what is fetched, M2 is
# Maven's local repository, EXPECTED_JAR must be among the jars delivered.
maven_fetch() {
  local who=$1 what=$2 pom=$3 home=$4 m2=$5 expected=$6
  local stamp="$home/.fetched" digest
  digest=$(sha256sum "$pom" | cut -d' ' -f1)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && return 0
  mkdir -p "$home"
  (
    flock 9
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && exit 0
    command -v mvn >/dev/null || {
      printf '%s: Maven is missing: install it (apt-get install maven; scripts/setup.sh does)\n' "$who" >&2
      exit 1
    }
    printf '%s: fetching %s from Maven Central into %s\n' "$who" "$what" "$home" >&2
    rm -rf "$home/libs.new"
    # A settings.xml beside the pom (mirrors) is used when there is one.
    local settings=()
    [ -f "$(dirname "$pom")/settings.xml" ] && settings=(-s "$(dirname "$pom")/settings.xml")
    if ! mvn -B -q -Dstyle.color=never "${settings[@]}" -Dmaven.repo.local="$m2" -f "$pom" \
      org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$home/libs.new" >"$home/fetch.log" 2>&1; then
      printf '%s: Maven could not fetch %s: %s\n' "$who" "$what" "$(tail -n 20 "$home/fetch.log")" >&2
      exit 1
    fi
    [ -f "$home/libs.new/$expected" ] || {
      printf '%s: Maven did not deliver %s\n' "$who" "$expected" >&2
      exit 1
    }
    rm -rf "$home/libs"
    mv "$home/libs.new" "$home/libs"
    echo "$digest" >"$stamp"
  ) 9>"$home/.lock"
}
