// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/urfave/cli/v2"
)

// keyFlag ties a flag of 'fairshare run' (and its FAIRSHARE_* variable) to
// the configuration key it sets. loadConfig applies a set flag through this
// table and the key's field, and the configuration reference
// (docs/configuration.md, 'make docs') is written from it, so the two
// cannot disagree.
type keyFlag struct {
	flag string
	key  string
	// invert: the flag is the key's negation (--no-bpf sets bpf: false).
	invert bool
}

// keyFlags are the flags that set one configuration key each. --pool, which
// sets pools.NAME.size and floor, is applied by setPool.
var keyFlags = []keyFlag{
	{flag: flagAdminSocket, key: "admin_socket"},
	{flag: flagStateDir, key: "state_dir"},
	{flag: flagPinDir, key: "pin_dir"},
	{flag: flagProjectsRoot, key: "projects_root"},
	{flag: flagMetrics, key: "metrics.listen"},
	{flag: flagFrontListen, key: "front.listen"},
	{flag: flagFrontUp, key: "front.upstream"},
	{flag: flagPermits, key: "permits.socket"},
	{flag: flagPermitsGroup, key: "permits.group"},
	{flag: flagFrontSocket, key: "front.socket"},
	{flag: flagNoBPF, key: "bpf", invert: true},
	{flag: flagMaxInFlight, key: "front.max_in_flight"},
	{flag: flagMaxConns, key: "listeners.max_conns"},
	{flag: flagReconcile, key: "reconcile"},
	{flag: flagSources, key: "projects.sources"},
}

// configField is the field of cfg (a pointer to a config.Config) that the
// dotted YAML key names, such as "front.limits.idle_timeout" or
// "pools.requests.size". A key into a map of structs (pools) yields a copy
// of the element, with store to write it back.
func configField(cfg *config.Config, key string) (v reflect.Value, store func(), err error) {
	v = reflect.ValueOf(cfg).Elem()
	store = func() {}
	parts := strings.Split(key, ".")
	for i := 0; i < len(parts); i++ {
		p := parts[i]
		switch v.Kind() {
		case reflect.Struct:
			f, ok := fieldByTag(v, p)
			if !ok {
				return reflect.Value{}, nil, fmt.Errorf("no configuration key %q (at %q)", key, p)
			}
			v = f
		case reflect.Map:
			m, k := v, reflect.ValueOf(p)
			elem := m.MapIndex(k)
			if !elem.IsValid() {
				return reflect.Value{}, nil, fmt.Errorf("no configuration key %q (%q is not among %s)", key, p, strings.Join(mapKeys(m), ", "))
			}
			cp := reflect.New(elem.Type()).Elem()
			cp.Set(elem)
			prev := store
			store = func() { m.SetMapIndex(k, cp); prev() }
			v = cp
		default:
			return reflect.Value{}, nil, fmt.Errorf("no configuration key %q (%q has no keys)", key, strings.Join(parts[:i], "."))
		}
	}
	return v, store, nil
}

// fieldByTag is the field of struct v whose yaml tag names key.
func fieldByTag(v reflect.Value, key string) (reflect.Value, bool) {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		if yamlName(t.Field(i)) == key {
			return v.Field(i), true
		}
	}
	return reflect.Value{}, false
}

// yamlName is the key of a struct field in the YAML file.
func yamlName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	return name
}

func mapKeys(m reflect.Value) []string {
	var out []string
	for _, k := range m.MapKeys() {
		out = append(out, k.String())
	}
	sort.Strings(out)
	return out
}

var durationType = reflect.TypeOf(time.Duration(0))

// setFromFlag writes flag kf's value in c into its key of cfg.
func setFromFlag(c *cli.Context, cfg *config.Config, kf keyFlag) error {
	v, store, err := configField(cfg, kf.key)
	if err != nil {
		return err
	}
	switch {
	case v.Type() == durationType:
		v.SetInt(int64(c.Duration(kf.flag)))
	case v.Kind() == reflect.Bool:
		v.SetBool(c.Bool(kf.flag) != kf.invert)
	case v.Kind() == reflect.String:
		v.SetString(c.String(kf.flag))
	case v.Kind() == reflect.Int || v.Kind() == reflect.Int64:
		v.SetInt(int64(c.Int(kf.flag)))
	case v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.String:
		v.Set(reflect.ValueOf(c.StringSlice(kf.flag)))
	default:
		return fmt.Errorf("--%s: key %s is a %s, which no flag sets", kf.flag, kf.key, v.Type())
	}
	store()
	return nil
}
