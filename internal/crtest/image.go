// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// ImageName is the one image of a test runtime: busybox as the pod sandbox
// (pause) image and as every container's image. No registry is reachable
// from the machines the tests run on, so it is built from the host's
// busybox-static and imported.
const ImageName = "fairshare.test/busybox:1"

// busyboxApplets are the commands the image provides, as links to busybox.
var busyboxApplets = []string{"sh", "sleep", "nc", "cat", "echo", "true", "ls"}

// writeImage writes an OCI image layout archive holding one layer (busybox
// at /bin/busybox and its applets) to w. Its entrypoint sleeps forever, which
// is all a pause container does.
func writeImage(w io.Writer, busybox string) error {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return fmt.Errorf("reading busybox: %w", err)
	}
	var layer bytes.Buffer
	lt := tar.NewWriter(&layer)
	mt := time.Unix(0, 0)
	if err := lt.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mt}); err != nil {
		return err
	}
	if err := lt.WriteHeader(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(bin)), ModTime: mt}); err != nil {
		return err
	}
	if _, err := lt.Write(bin); err != nil {
		return err
	}
	for _, a := range busyboxApplets {
		if err := lt.WriteHeader(&tar.Header{Name: "bin/" + a, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777, ModTime: mt}); err != nil {
			return err
		}
	}
	if err := lt.Close(); err != nil {
		return err
	}

	type desc struct {
		MediaType   string            `json:"mediaType"`
		Digest      string            `json:"digest"`
		Size        int               `json:"size"`
		Annotations map[string]string `json:"annotations,omitempty"`
	}
	blobs := map[string][]byte{}
	put := func(mediaType string, b []byte) desc {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[d] = b
		return desc{MediaType: mediaType, Digest: d, Size: len(b)}
	}
	layerDesc := put("application/vnd.oci.image.layer.v1.tar", layer.Bytes())
	cfg, _ := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Entrypoint": []string{"/bin/sleep", "infinity"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDesc.Digest}},
	})
	cfgDesc := put("application/vnd.oci.image.config.v1+json", cfg)
	man, _ := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": cfgDesc, "layers": []desc{layerDesc},
	})
	manDesc := put("application/vnd.oci.image.manifest.v1+json", man)
	manDesc.Annotations = map[string]string{"io.containerd.image.name": ImageName}
	index, _ := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []desc{manDesc}})

	ot := tar.NewWriter(w)
	file := func(name string, b []byte) error {
		if err := ot.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(b)), ModTime: mt}); err != nil {
			return err
		}
		_, err := ot.Write(b)
		return err
	}
	if err := file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := file("index.json", index); err != nil {
		return err
	}
	for d, b := range blobs {
		if err := file("blobs/sha256/"+d[len("sha256:"):], b); err != nil {
			return err
		}
	}
	return ot.Close()
}
