// The gpuaas.v1 protobuf contracts, loaded at run time from proto/ with protobufjs: nothing is
// generated, so the client reads the .proto files exactly as they are in the tree.
//
// Include paths: the repository's proto/ directory, then protobufjs's own google/protobuf
// definitions (any/timestamp are built into protobufjs; descriptor.proto, needed by types.proto's
// `text` enum-value option, ships in the package).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import protobuf from "protobufjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);

// The repository's proto/ directory (tests/contract/js -> ../../../proto), unless overridden.
export const defaultProtoDir = path.resolve(here, "..", "..", "..", "proto");

// toObject options: enums as their names, 64-bit integers as decimal strings, the name of the
// set field of every oneof, and proto3 defaults filled in (an unset enum reads as ..._UNSPECIFIED,
// an unset repeated field as []).
export const objectOptions = {
  enums: String,
  longs: String,
  oneofs: true,
  defaults: true,
  arrays: true,
};

// Loads every gpuaas/v1/*.proto under `protoDir`; returns a helper around the resolved root.
export function loadContracts(protoDir = defaultProtoDir) {
  const pbDir = path.dirname(require.resolve("protobufjs/package.json"));
  const includes = [protoDir, pbDir];
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => {
    if (path.isAbsolute(target) && fs.existsSync(target)) return target;
    for (const dir of includes) {
      const p = path.join(dir, target);
      if (fs.existsSync(p)) return p;
    }
    // google/protobuf/{any,timestamp,...}.proto: protobufjs's bundled definitions.
    return target;
  };
  const v1 = path.join(protoDir, "gpuaas", "v1");
  if (!fs.existsSync(v1)) throw new Error(`no proto directory at ${v1}`);
  const files = fs
    .readdirSync(v1)
    .filter((f) => f.endsWith(".proto"))
    .sort()
    .map((f) => `gpuaas/v1/${f}`);
  root.loadSync(files, { keepCase: true });
  root.resolveAll();
  return new Contracts(root, files);
}

export class Contracts {
  constructor(root, files) {
    this.root = root;
    this.files = files;
  }

  // The message type `name` ("gpuaas.v1.Reply"); throws if the contracts have no such type.
  type(name) {
    return this.root.lookupType(name.replace(/^\./, ""));
  }
  enumType(name) {
    return this.root.lookupEnum(name.replace(/^\./, ""));
  }

  // Encodes a plain object as `typeName`, rejecting fields the contract does not have.
  encode(typeName, obj) {
    const t = this.type(typeName);
    checkFields(t, obj, typeName);
    const msg = t.fromObject(obj);
    const err = t.verify(msg);
    if (err) throw new Error(`${typeName}: ${err}`);
    return t.encode(msg).finish();
  }

  // Decodes `bytes` as `typeName` into a plain object (objectOptions).
  decode(typeName, bytes) {
    const t = this.type(typeName);
    return t.toObject(t.decode(bytes), objectOptions);
  }

  // A google.protobuf.Any holding `obj` as `typeName`.
  pack(typeName, obj) {
    return {
      type_url: `type.googleapis.com/${typeName}`,
      value: this.encode(typeName, obj),
    };
  }

  // Decodes a google.protobuf.Any (as toObject gives it: {type_url, value}) by its type_url.
  // Returns {type, value}; throws if the type is not one of the contracts' or not `expected`.
  unpack(any, expected) {
    if (!any || !any.type_url) throw new Error(`empty Any (expected ${expected ?? "a message"})`);
    const typeName = any.type_url.slice(any.type_url.lastIndexOf("/") + 1);
    if (expected && typeName !== expected) {
      throw new Error(`Any holds ${typeName} (type_url ${any.type_url}), expected ${expected}`);
    }
    let value;
    try {
      value = this.decode(typeName, any.value ?? new Uint8Array());
    } catch (e) {
      throw new Error(`cannot decode Any ${any.type_url}: ${e.message}`);
    }
    return { type: typeName, value };
  }

  // The text form of an enum value (types.proto): its `text` option, else the lowercase name
  // after the enum's common prefix (ALLOCATION_STATE_ACTIVE -> "active").
  enumText(enumName, valueName) {
    const e = this.enumType(enumName);
    if (!(valueName in e.values)) throw new Error(`${valueName} is not a ${enumName}`);
    const opts = (e.valuesOptions && e.valuesOptions[valueName]) || {};
    const text = opts["(text)"] ?? opts["(gpuaas.v1.text)"];
    if (text) return text;
    const prefix = enumPrefix(Object.keys(e.values));
    return valueName.slice(prefix.length).toLowerCase();
  }

  // True when `valueName` is a known, non-zero value of the enum.
  isValidEnum(enumName, valueName) {
    const e = this.enumType(enumName);
    return typeof valueName === "string" && valueName in e.values && e.values[valueName] !== 0;
  }
}

// Throws if `obj` (or a nested message) names a field its type does not have, or an enum value
// it does not know: fromObject would drop either silently, and a request that loses a field is not the request the client meant.
function checkFields(type, obj, where) {
  if (obj === null || typeof obj !== "object" || obj instanceof Uint8Array) return;
  for (const [k, v] of Object.entries(obj)) {
    const f = type.fields[k];
    if (!f) throw new Error(`${where}: ${type.fullName.slice(1)} has no field ${k}`);
    f.resolve();
    if (f.map) continue;
    if (f.resolvedType instanceof protobuf.Enum && v !== null && v !== undefined) {
      for (const item of f.repeated ? v : [v]) {
        const known = typeof item === "number" ? item in f.resolvedType.valuesById : item in f.resolvedType.values;
        if (!known) throw new Error(`${where}.${k}: ${item} is not a ${f.resolvedType.fullName.slice(1)}`);
      }
    }
    if (f.resolvedType instanceof protobuf.Type && v !== null && v !== undefined) {
      for (const item of f.repeated ? v : [v]) checkFields(f.resolvedType, item, `${where}.${k}`);
    }
  }
}

// The common "FOO_BAR_" prefix of an enum's value names.
function enumPrefix(names) {
  let p = names[0] ?? "";
  for (const n of names) {
    while (!n.startsWith(p)) p = p.slice(0, -1);
  }
  return p.slice(0, p.lastIndexOf("_") + 1);
}
